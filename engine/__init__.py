"""The scheduler side: the continuous-batching engine over the block manager and the model
nodes (`LLM`, `LLMEngine`, the async engine thread, the node executors) and, in `engine.api`,
the OpenAI-compatible server. Nothing below it imports this package; the demo (`demo/`) sits
above it."""
