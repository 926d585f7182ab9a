"""Small value objects the client returns where the core has no equivalent.

Where the core already has the right shape (`AllocateResult`, `AppendResult`,
`SequenceView`, `CopyOp`, `DefragPlan`) the client returns the core's dataclass, so code
written against the embedded core and code written against the service read the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from block_manager.client.errors import BlockManagerError
from block_manager.core.types import CopyOp, PoolId, SeqId, SequenceView


@dataclass(slots=True, frozen=True)
class NodeRegistration:
    """What `RegisterNode` granted: send `epoch` on every node-scoped call and heartbeat
    well within `lease_ttl_s`."""

    pool_id: PoolId
    epoch: int
    lease_ttl_s: float
    block_size: int
    num_blocks: int
    prefetch_window: int


@dataclass(slots=True, frozen=True)
class HeartbeatResult:
    lease_ttl_s: float
    draining: bool
    last_pending_op_id: int | None  # None: no pending copy op


@dataclass(slots=True, frozen=True)
class AllocateSpec:
    """One admission of a batched `Allocate`: exactly one of `token_ids` / `num_tokens`."""

    seq_id: SeqId
    pool_id: PoolId
    token_ids: tuple[int, ...] | None = None
    num_tokens: int | None = None
    salt: str | None = None


@dataclass(slots=True, frozen=True)
class ItemFailure:
    """A per-item failure of a batched call; that sequence is unchanged on the server."""

    seq_id: SeqId
    error: BlockManagerError


@dataclass(slots=True, frozen=True)
class TablesUpdate:
    """`GetTables`: the tables newer than the caller's versions and the copy ops to run
    before them (op_id ascending)."""

    tables: tuple[SequenceView, ...]
    copy_ops: tuple[CopyOp, ...]


@dataclass(slots=True, frozen=True)
class PoolRoute:
    """One candidate pool for a prompt, best first (the core's `RouteEntry` + address)."""

    pool_id: PoolId
    num_cached_tokens: int
    num_free_blocks: int
    address: str


__all__ = ["AllocateSpec", "HeartbeatResult", "ItemFailure", "NodeRegistration", "PoolRoute", "TablesUpdate"]
