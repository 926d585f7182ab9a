"""The engine's two failure kinds: a request it cannot serve, and a step it cannot complete."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot serve (too long for the model or for the KV memory), or an
    engine that cannot start (no model node)."""


class EngineFailure(Exception):
    """A step the engine cannot complete: the block manager refused an item it planned, a node
    refused a step for a reason recovery cannot fix (credentials, a malformed request; or 20
    refusals in a row), or the block manager stayed unreachable. Not the request's fault: the
    engine stops and says why (an API server answers 503), rather than retrying a step that
    fails the same way."""


__all__ = ["EngineError", "EngineFailure"]
