"""The engine's failure kinds: a request it cannot serve, a step it cannot complete, and the
typed failures of a model node's step (the executors raise them; the scheduler never sees a
gRPC status)."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot serve (too long for the model or for the KV memory), or an
    engine that cannot start (no model node)."""


class InvalidEngineArgs(EngineError, ValueError):
    """Arguments of `LLM` that cannot go together (a node's setting given with
    `block_manager=`, half of the disk tier's pair): the caller's mistake, so also a
    `ValueError` (`pagedkv-serve` answers it as a usage error, exit 2)."""


class EngineFailure(Exception):
    """A step the engine cannot complete: the block manager refused an item it planned, a node
    refused a step for a reason recovery cannot fix (credentials, a malformed request; or 20
    refusals in a row), or the block manager stayed unreachable. Not the request's fault: the
    engine stops and says why (an API server answers 503), rather than retrying a step that
    fails the same way."""


class NoNodeOwned(EngineError):
    """A fleet member that owns no model node (its nodes went to other engines, or away) for
    longer than a membership TTL refuses requests, and fails those it queued, rather than hold
    them until a node comes back: another engine can serve them now (the API answers 503, which
    the router retries elsewhere)."""


class EpochDropped(Exception):
    """The block manager dropped a sequence the engine held (running or swapped) with its node's
    epoch: the step that wrote it failed, or its node registered anew. Made by the scheduler
    from the Step answer's `dropped` ids, so the failure table has a class to look up."""

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"sequence {seq_id!r} dropped with its node's epoch")
        self.seq_id = seq_id


class NodeOutOfPlacement(Exception):
    """A node the engine took out of placement (it did not answer) holds a swapped sequence:
    it cannot come back from that host tier while the node is out."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id!r} is out of placement")
        self.node_id = node_id


class PoolLost(Exception):
    """A pool this engine drove in the fleet is no longer its own, or is its own again under a new
    lease (`engine.fleet_pools`): the block manager handed it to another member while this engine
    missed its heartbeats, and dropped the engine's sequences there with the handover."""

    def __init__(self, pool_id: str) -> None:
        super().__init__(f"pool {pool_id!r} went to another fleet member")
        self.pool_id = pool_id


class PoolReleasing(Exception):
    """The block manager asked the engine to hand a pool over to another fleet member
    (rebalancing): the engine's sequences there give their blocks up before it does."""

    def __init__(self, pool_id: str) -> None:
        super().__init__(f"pool {pool_id!r} is handed to another fleet member")
        self.pool_id = pool_id


class NodeError(Exception):
    """A model node's step failed; the node wrote nothing of it that counts (the step is
    reported failed and the block manager drops what it wrote)."""

    def __init__(self, node_id: str, message: str, *, code: str = "") -> None:
        super().__init__(f"node {node_id!r}: {code + ': ' if code else ''}{message}")
        self.node_id = node_id
        self.message = message
        self.code = code           # the transport's status name, for logs


class NodeUnreachable(NodeError):
    """No answer (the process died, the host is gone, the step timed out): the node leaves
    placement until a probe finds it back."""


class NodeMovedOn(NodeError):
    """The node no longer holds the step's state (restarted with a new epoch, fenced, or its
    tables disagree with the step): the step's sequences recompute, there or elsewhere."""


class NodeRefused(NodeError):
    """The node refused the step for a reason recovery cannot fix (credentials, a malformed
    request): a bug or a misconfiguration."""


__all__ = ["EngineError", "EngineFailure", "EpochDropped", "NodeError", "NodeMovedOn", "NodeOutOfPlacement",
           "NodeRefused", "NodeUnreachable", "NoNodeOwned", "PoolLost", "PoolReleasing"]
