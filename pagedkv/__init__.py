"""pagedkv's ground floor: the generated protocol (`pagedkv.v1`), settings, logging, health check,
the gRPC server lifecycle, the client retry discipline and the one percentile definition.

It imports nothing of the floors above it (docs/architecture.md); public entry points of the
upper floors are re-exported lazily here, imported only when first used.
"""

from typing import Any

# name -> module of the floor above that defines it (imported on first use only)
_ENTRY_POINTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.params",
    "RequestOutput": "engine.params",
    "CompletionOutput": "engine.params",
}


def __getattr__(name: str) -> Any:
    """`from pagedkv import LLM, SamplingParams`: the engine's public API, loaded lazily so the
    ground floor never imports the floors above it at import time."""
    module = _ENTRY_POINTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = list(_ENTRY_POINTS)
