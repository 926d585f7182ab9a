"""Small value objects the client returns where the core has no equivalent.

Where the core already has the right shape (`SequenceView`, `CopyOp`, `TableDelta`,
`DefragPlan`) the client returns the core's dataclass, so code written against the embedded
core and code written against the service read the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from block_manager.client.errors import BlockManagerError
from block_manager.core.types import CopyOp, PlanId, PoolId, SeqId, SequenceView, StepId, TableDelta


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


@dataclass(slots=True, frozen=True)
class ItemFailure:
    """A per-item failure of a step; that sequence (or admission, or fork) changed nothing."""

    seq_id: SeqId
    error: BlockManagerError


@dataclass(slots=True, frozen=True)
class TablesUpdate:
    """`GetTables` (a node's cold cache): the tables newer than the caller's versions, as of
    the pool's last closed step."""

    tables: tuple[SequenceView, ...]
    last_step_id: int


@dataclass(slots=True, frozen=True)
class PoolRoute:
    """One candidate pool for a prompt, best first (the core's `RouteEntry` + address)."""

    pool_id: PoolId
    num_cached_tokens: int
    num_free_blocks: int
    address: str
    # prefix fetch (docs/prefix_fetch.md): tokens fetchable from `fetch_pool_id`, tokens missing
    num_fetchable_tokens: int = 0
    num_missing_tokens: int = 0
    fetch_pool_id: str = ""
    # fleet mode: the scheduler owning the pool ("" / 0: no fleet member owns it), its API
    # address and load as of its last heartbeat
    scheduler_id: str = ""
    scheduler_address: str = ""
    scheduler_num_running: int = 0
    scheduler_num_waiting: int = 0


@dataclass(frozen=True, slots=True)
class OwnedPool:
    """A pool a fleet member owns (drives): its node's gRPC address and the lease epoch."""

    pool_id: str
    address: str
    lease_epoch: int


@dataclass(frozen=True, slots=True)
class FleetAssignment:
    """A `SchedulerHeartbeat` answer: the pools this scheduler owns now (it steps on those and
    no others), those of them it is asked to hand over (stop admitting there, free or preempt
    its sequences there, then name them in `released_pool_ids` of a later heartbeat), and the
    membership TTL (heartbeat every `ttl_s / 3`). `lending_pool_ids`: owned pools whose open
    step holds serve grants for another scheduler's prefix fetch: send a Step soon (an idle
    scheduler: `client.deliver_grants()`) so their nodes get them."""

    pools: tuple[OwnedPool, ...]
    release_pool_ids: tuple[str, ...]
    ttl_s: float
    lending_pool_ids: tuple[str, ...] = ()

    @property
    def pool_ids(self) -> tuple[str, ...]:
        return tuple(p.pool_id for p in self.pools)


@dataclass(frozen=True, slots=True)
class SchedulerStatus:
    """One fleet member as the admin plane sees it (`AdminClient.list_schedulers`)."""

    scheduler_id: str
    address: str
    pool_ids: tuple[str, ...]
    release_pool_ids: tuple[str, ...]
    pin_pool_ids: tuple[str, ...]
    num_running: int
    num_waiting: int
    remaining_s: float


@dataclass(slots=True, frozen=True)
class PoolStepInfo:
    """One closed step of one pool: what its compute node must apply inside the scheduler's
    Forward (copy ops first, then the deltas and drops). `message` is the `PoolStep` itself:
    pass it verbatim to the node (`ComputeNodeClient.forward(..., steps=[...])`), then report
    the Forward with `client.report(step, ok)`."""

    pool_id: PoolId
    epoch: int
    step_id: StepId
    copy_ops: tuple[CopyOp, ...]
    deltas: tuple[TableDelta, ...]
    dropped_seq_ids: tuple[SeqId, ...]
    plan_id: PlanId | None
    reset: bool
    base_step_id: StepId
    message: Any


@dataclass(slots=True, frozen=True)
class StepSettled:
    """What a report did on the server: the steps settled up to `settled_step`, the defrag
    plans that committed or aborted, the sequences dropped because their step failed."""

    pool_id: PoolId
    settled_step: int
    committed_plan_ids: tuple[PlanId, ...]
    aborted_plan_ids: tuple[PlanId, ...]
    dropped_seq_ids: tuple[SeqId, ...]


@dataclass(slots=True, frozen=True)
class Admission:
    """An allocation of the step: the sequence holds `num_tokens` tokens (the prompt, or its
    first chunk), the first `num_cached_tokens` already in the cache (not to compute)."""

    seq_id: SeqId
    pool_id: PoolId
    num_cached_tokens: int
    num_tokens: int


@dataclass(slots=True, frozen=True)
class SeqSlots:
    """What `Forward` needs for one appended sequence of the step: write `num_new_tokens` at
    the tail, the context then holds `context_len` tokens. `deferred`: answered by the client
    (an in-block decode append), reported to the block manager later."""

    seq_id: SeqId
    num_new_tokens: int
    context_len: int
    deferred: bool = False


__all__ = [
    "Admission",
    "HeartbeatResult",
    "ItemFailure",
    "NodeRegistration",
    "PoolRoute",
    "PoolStepInfo",
    "SeqSlots",
    "StepSettled",
    "TablesUpdate",
]
