"""Typed errors of the compute node, each with the gRPC status the servicer answers with.

The engine raises these before it writes anything, so an error status always means the pool
is untouched. Anything else that escapes becomes INTERNAL with a generic message (and the
exception is logged), never a crashed server.
"""

from __future__ import annotations

import grpc


class ComputeNodeError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidForward(ComputeNodeError):
    """Malformed request: shapes, dtypes, layers, slots that are not the sequence's own."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownSequence(ComputeNodeError):
    """The block manager has no such sequence in this node's pool."""

    code = grpc.StatusCode.NOT_FOUND


class StaleTable(ComputeNodeError):
    """A step's table delta does not apply to the node's version of the table (the node and
    the block manager disagree about the table): the scheduler should drop and re-admit it."""

    code = grpc.StatusCode.ABORTED


class StaleStep(ComputeNodeError):
    """The Forward's steps do not continue from the node's last applied step: a step was not
    delivered. The scheduler must send every step of the pool, in order."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NodeFenced(ComputeNodeError):
    """The node's epoch was fenced by the block manager: its sequences are gone. The node
    re-registers (new epoch, empty pool); the caller must re-admit its sequences."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotRegistered(ComputeNodeError):
    """The node has no live registration (starting up, or the block manager is unreachable)."""

    code = grpc.StatusCode.UNAVAILABLE


class ModelLoading(ComputeNodeError):
    """The node listens (health, node info) while it loads its model: a Generate now is early,
    not wrong (a node restarted in place at its old address gets the calls meant for the old
    one), so it is refused as unavailable, never as a bad request."""

    code = grpc.StatusCode.UNAVAILABLE


class BlockManagerRefused(ComputeNodeError):
    """The block manager refused a call the node made for a Forward (a cold table fetch) with
    a status the other classes do not name (RESOURCE_EXHAUSTED, INTERNAL, ...): the Forward is
    refused with that same status, so its meaning reaches the scheduler intact (UNAVAILABLE
    would make it retry a refusal forever). A refusal of the node's own credentials is
    INTERNAL (the scheduler's credentials are not the problem)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class BlockManagerUnavailable(ComputeNodeError):
    """A node → block manager call failed transiently; retrying the Forward is safe."""

    code = grpc.StatusCode.UNAVAILABLE


class PeerFetchFailed(ComputeNodeError):
    """A prefix fetch's blocks could not be pulled from the source node and this step cannot
    recompute them (an attention-only node's Forward: the scheduler sends K/V, not tokens; or a
    fetch for a sequence the step does not compute). The step failed as a whole before anything
    of it was applied; ABORTED: the scheduler reports it failed and recomputes its sequences
    (docs/prefix_fetch.md), without blaming this node's reachability."""

    code = grpc.StatusCode.ABORTED
