"""Ids and the plain data classes the core speaks.

The core never hands out its internal mutable objects: every result is a small
value object (tuples, not lists) so callers cannot corrupt bookkeeping by mutating
what they were given, and so results compare by value in tests and journal replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NewType

from block_manager.core.errors import CoreError

SeqId = NewType("SeqId", str)
PoolId = NewType("PoolId", str)
BlockId = NewType("BlockId", int)
PlanId = NewType("PlanId", int)
StepId = NewType("StepId", int)

CopyKind = Literal["cow", "defrag"]
DefragKind = Literal["compaction", "contiguity"]


@dataclass(slots=True, frozen=True)
class CopyOp:
    """Copy the K/V of block `src` into block `dst` (all layers) on the pool's node.

    `op_id` increases per pool; a compute node applies a pool's pending ops strictly in
    `op_id` order, before any forward that writes, and then acknowledges them.
    """

    op_id: int
    src: BlockId
    dst: BlockId
    kind: CopyKind


@dataclass(slots=True, unsafe_hash=True)
class TableDelta:
    """How one sequence's block table changed during one step: what a compute node applies to
    its cached copy (whose version must be `base_version`) to get `version`.

    `base_version == 0` announces a new table (allocate, fork): `appended` is the whole table
    and `num_tokens` the positions it already covers (a cached prefix, a parent's tokens), so
    the node's first write for the sequence starts there. Otherwise `replaced` lists
    `(position, block)` entries rewritten below the old length (copy-on-write of the last
    block, defrag moves) and `appended` the blocks added at the end.

    Not frozen (but hashable, by value) only because a step builds one per table it changed
    (frozen init costs ~9k instructions against ~1k: issue 45, callgrind); treat it as read-only.
    """

    seq_id: SeqId
    base_version: int
    version: int
    num_tokens: int
    replaced: tuple[tuple[int, BlockId], ...]
    appended: tuple[BlockId, ...]


@dataclass(slots=True, unsafe_hash=True)
class StepOutput:
    """One closed step of one pool: everything its compute node must apply, in order, inside
    the scheduler's Forward for the step — the copy ops first (copy-on-write and defrag
    moves, before any write of the step), then the table deltas and the dropped sequences.

    The scheduler reports the Forward back with `settle_steps`; only then do the step's writes
    count as done (a block may become a defrag source or a copy-on-write source only once the
    Forward that wrote it is known complete).

    Not frozen (hashable by value) for the same reason as `TableDelta`: one per closed step,
    on every Step's path; treat it as read-only.
    """

    pool_id: PoolId
    step_id: StepId
    copy_ops: tuple[CopyOp, ...]
    deltas: tuple[TableDelta, ...]
    dropped_seq_ids: tuple[SeqId, ...]
    plan_id: PlanId | None = None
    reset: bool = False    # the node forgets every cached table of the pool before this step
    base_step_id: StepId = StepId(0)  # the step it builds on (step_id - 1 unless steps failed)
    # Device<->host moves (block_manager.core.tiers.TierOp), run before everything else of the
    # step: all device->host moves, then all host->device moves, then the copy ops.
    tier_ops: tuple = ()
    # Prefix fetch (block_manager.core.fetch): FetchOps this pool's node pulls inside the step
    # (before its Forward reads them), ServeGrants it serves to other nodes from this step on.
    fetches: tuple = ()
    serves: tuple = ()


@dataclass(slots=True, unsafe_hash=True)
class SettleResult:
    """What settling a pool's steps did: plans whose moves are now known copied (committed,
    their tables rewritten in the next step), plans aborted because their step failed, and the
    sequences dropped because a step that wrote them failed.

    Not frozen (hashable by value), like `StepOutput`: one per report; treat it as read-only."""

    pool_id: PoolId
    settled_step: StepId
    committed_plan_ids: tuple[PlanId, ...]
    aborted_plan_ids: tuple[PlanId, ...]
    dropped_seq_ids: tuple[SeqId, ...]


@dataclass(slots=True, frozen=True)
class AllocateResult:
    """What a new sequence got: its table, how much of the prompt was cached, and where
    the rest of the prompt's K/V must be written.

    `slot_mapping` covers tokens `num_cached_tokens … num_tokens-1` (slot =
    block_id * block_size + offset).
    """

    seq_id: SeqId
    pool_id: PoolId
    block_table: tuple[BlockId, ...]
    num_cached_tokens: int
    slot_mapping: tuple[int, ...]
    version: int


@dataclass(slots=True)
class AppendRequest:
    """One sequence's share of a scheduler step: `num_new_tokens` slots to add.

    `token_ids`, when given, must have `num_new_tokens` entries; they let the core hash
    blocks that become full so later prompts can hit them. Omitting them stops hashing
    for that sequence (the chain cannot be continued without the content).
    Not frozen: callers build hundreds per step and frozen init costs ~3x; the core
    copies what it keeps, so mutating a request afterwards is harmless.
    """

    seq_id: SeqId
    num_new_tokens: int
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class AppendResult:
    """Slots for the new tokens of one sequence, the blocks it gained, and the copies
    (copy-on-write) the node must run before writing them.

    Not frozen only because it is built 256 times per scheduler step on the hot path
    (frozen init is several times slower); treat it as read-only.
    """

    seq_id: SeqId
    slot_mapping: tuple[int, ...]
    new_block_ids: tuple[BlockId, ...]
    copy_ops: tuple[CopyOp, ...]
    version: int
    num_tokens: int


@dataclass(slots=True)
class AppendFailure:
    """A per-sequence failure inside a batched append; that sequence is unchanged."""

    seq_id: SeqId
    error: CoreError


@dataclass(slots=True, frozen=True)
class SequenceView:
    """A read-only copy of one sequence's table.

    `version` changes whenever `block_table` changes (new block, copy-on-write, defrag),
    not when tokens are added inside the last block; `num_tokens` is current at the time
    the view was taken.
    """

    seq_id: SeqId
    pool_id: PoolId
    block_table: tuple[BlockId, ...]
    num_tokens: int
    version: int


@dataclass(slots=True, frozen=True)
class RouteEntry:
    """One candidate pool for a prompt, as ranked by `BlockManager.route`."""

    pool_id: PoolId
    num_cached_tokens: int
    num_free_blocks: int
    # Prefix fetch (docs/prefix_fetch.md): prompt tokens another pool (`fetch_pool_id`) holds
    # beyond this pool's own hits, and the tokens neither has (recomputed); `num_cached_tokens`
    # is the local part (device hits).
    num_fetchable_tokens: int = 0
    num_missing_tokens: int = 0
    fetch_pool_id: PoolId | None = None


@dataclass(slots=True, frozen=True)
class DefragPlan:
    """Moves of one outstanding defragmentation plan (copy ops of step `step_id`)."""

    plan_id: PlanId
    pool_id: PoolId
    kind: DefragKind
    moves: tuple[CopyOp, ...]
    step_id: StepId = StepId(0)   # the step whose Forward runs the moves


@dataclass(slots=True, frozen=True)
class DefragPolicy:
    """When `defrag_due` proposes a defragmentation.

    Any threshold set to None is disabled. `every_n_steps` counts `append_slots` calls
    touching the pool since the last committed plan; `max_high_water_ratio` compares the
    high-water mark with the number of used blocks; `min_contiguity` is the lowest
    acceptable contiguity score (see `defrag.contiguity_score`).
    """

    every_n_steps: int | None = 1000
    max_high_water_ratio: float | None = 1.5
    min_contiguity: float | None = 0.5

    def __post_init__(self) -> None:
        from block_manager.core.errors import InvalidRequest

        n = self.every_n_steps
        if n is not None and (type(n) is not int or n < 1):
            raise InvalidRequest(f"every_n_steps must be an int >= 1 or None, got {n!r}")
        r = self.max_high_water_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or r < 1.0):
            raise InvalidRequest(f"max_high_water_ratio must be >= 1.0 or None, got {r!r}")
        c = self.min_contiguity
        if c is not None and (
            isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0
        ):
            raise InvalidRequest(f"min_contiguity must be in [0, 1] or None, got {c!r}")


@dataclass(slots=True, frozen=True)
class PoolMetrics:
    """Point-in-time counters and gauges of one pool.

    `waste_slots` is internal fragmentation: slots of used blocks that hold no token
    (only partial last blocks contribute; a block shared by forks counts once).
    Prefix counters are in tokens: `prefix_query_tokens` are prompt tokens looked up,
    `prefix_hit_tokens` those served from the cache.
    """

    pool_id: PoolId
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_reserved_blocks: int
    usage: float
    high_water_mark: int
    num_tokens: int
    allocated_slots: int
    waste_slots: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    evictions: int
    defrag_moves: int
    compaction_plans: int   # committed defrag plans by kind
    contiguity_plans: int
    aborted_plans: int
    num_sequences: int
    contiguity: float



@dataclass(slots=True, frozen=True)
class HostTierMetrics:
    """Point-in-time counters and gauges of one pool's host tier (block_manager.core.tiers).

    `host_hit_tokens` are prompt tokens served by onboarding host blocks (the device hits stay
    in `PoolMetrics.prefix_hit_tokens`); `host_evictions` are host blocks dropped for good."""

    pool_id: PoolId
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_swapped_sequences: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int
    host_hit_tokens: int
    host_evictions: int
    swap_outs: int
    swap_ins: int


@dataclass(slots=True, frozen=True)
class DiskTierMetrics:
    """Point-in-time counters and gauges of one pool's disk tier (block_manager.core.disk_tier).

    `disk_offloaded_blocks`: host blocks spilled to disk on host eviction; `disk_onboarded_blocks`
    / `disk_hit_tokens`: prefix blocks / prompt tokens served from disk (disk->host->device);
    `disk_evictions`: disk slots overwritten (LRU) for good."""

    pool_id: PoolId
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    disk_offloaded_blocks: int
    disk_onboarded_blocks: int
    disk_hit_tokens: int
    disk_evictions: int
