"""The OpenAI-compatible HTTP server over the engine: wire format, generation, metrics, CLI."""
