"""`BlockManager`: the deterministic state machine over pools, sequences and blocks.

Every public method either raises a `CoreError` before touching anything or completes
fully, so the service can journal a call and replay it to the same state. Nothing here
reads a clock, draws random numbers or iterates an unordered collection whose order
could leak into a result.

The one-sequencer contract (steps.py): everything a call changes in a pool's memory is
recorded in the pool's open step; `close_step` hands it to the scheduler, whose Forward for
the step runs the step's copy ops (copy-on-write, defrag moves) before any of its writes and
applies its table deltas; the scheduler reports the Forward with `settle_steps`. A block is a
defrag or copy-on-write source only once the step that wrote it is settled, a defrag plan
commits when the step carrying its moves is settled, and a failed step drops what it wrote.
So even when a copy's source is released and handed to another sequence in the same step,
the copy still reads the old content: the new owner's writes come after the step's copies.

This class is the facade: it keeps the two indexes (pools, sequences) and hands each call to
the module of its concept — the tiers (block_tier.py: pool.py, tiers.py, disk_tier.py), the
prefix chain and routing (prefix.py), a sequence's life (allocation.py), appends (append*.py),
steps (step_work.py, steps.py), swap.py, fetch.py, defrag.py, metrics.py, fsck.py, snapshot.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from operator import attrgetter
from typing import Any

from block_manager.core import allocation as _allocation
from block_manager.core import defrag as _defrag
from block_manager.core import kv_events as _kv_events
from block_manager.core import metrics as _metrics
from block_manager.core import prefix as _prefix
from block_manager.core import steps as _steps
from block_manager.core import swap as _swap
from block_manager.core.append import AppendOutcome, append_columns, can_append, resolve_late_columns
from block_manager.core.append_slots import append_slots
from block_manager.core.disk_tier import SeedBlock
from block_manager.core.errors import (
    CoreError,
    InvalidRequest,
    UnknownPool,
    check_count,
)
from block_manager.core.fsck import fsck
from block_manager.core.hashing import token_array
from block_manager.core.kv_events import IndexView, KvChange
from block_manager.core.pool import MAX_POOL_BLOCKS, Pool, build_pool
from block_manager.core.sequence import Sequence, newer_views
from block_manager.core.slots import slot_range
from block_manager.core.snapshot import CoreParts, from_snapshot, to_snapshot
from block_manager.core.types import (
    AllocateResult,
    AppendFailure,
    AppendRequest,
    AppendResult,
    BlockId,
    DefragKind,
    DefragPlan,
    DefragPolicy,
    DiskTierMetrics,
    HostTierMetrics,
    PlanId,
    PoolId,
    PoolMetrics,
    RouteEntry,
    SeqId,
    SequenceView,
    SettleResult,
    StepId,
    StepOutput,
)

DEFAULT_MAX_UNSETTLED_STEPS = 4
_POOL_ID = attrgetter("pool_id")


class BlockManager:
    """Pools, sequences and their block tables; see docs/core_api.md for the contract."""

    def __init__(
        self,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        defrag_policy: DefragPolicy | None = None,
        max_unsettled_steps: int = DEFAULT_MAX_UNSETTLED_STEPS,
    ) -> None:
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not (
            0.0 <= watermark < 1.0
        ):
            raise InvalidRequest(f"watermark must be in [0, 1), got {watermark!r}")
        self.watermark = float(watermark)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.defrag_policy = defrag_policy if defrag_policy is not None else DefragPolicy()
        self.max_unsettled_steps = check_count("max_unsettled_steps", max_unsettled_steps, 1)
        self._pools: dict[PoolId, Pool] = {}
        self._seqs: dict[SeqId, Sequence] = {}
        self._next_plan_id = 1
        self._kv = _kv_events.KvRecorder()   # prefix-index changes, once recorded (kv_events.py)

    # ---- KV events --------------------------------------------------------------------
    def record_kv_changes(self) -> None:
        """From now on every prefix-index change of every pool is recorded (O(1) each) until
        `take_kv_changes` hands them over (see core/kv_events.py)."""
        self._kv.record(self._pools)

    def take_kv_changes(self) -> list[KvChange]:
        """The changes recorded since the last call, oldest first (empty when not recording)."""
        return self._kv.take()

    def num_prefix_hashes(self, pool_id: PoolId) -> int:
        """Blocks of the pool's device tier findable by their hash (in use or cached)."""
        return len(self._pool(pool_id).prefix_index)

    def kv_index_view(self, with_tokens: bool = False) -> IndexView:
        """Every tier's prefix index as the KV events describe it (what a replay reproduces);
        `with_tokens`: each entry also carries the block's token ids."""
        return _kv_events.index_view(self._pools, with_tokens)

    # ---- lookups --------------------------------------------------------------------
    def _pool(self, pool_id: PoolId) -> Pool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise UnknownPool(f"unknown pool {pool_id!r}")
        return pool

    def _seq(self, seq_id: SeqId) -> Sequence:
        return _swap.find_sequence(self._pools, self._seqs, seq_id)

    def _swapped_pool(self, seq_id: SeqId) -> Pool | None:
        """The pool whose host tier holds `seq_id` swapped out, if any."""
        return _swap.swapped_pool(self._pools, seq_id)

    def _watermark_blocks(self, pool: Pool) -> int:
        return int(self.watermark * pool.num_blocks)

    @property
    def pool_ids(self) -> list[PoolId]:
        return list(self._pools)

    # ---- pools ----------------------------------------------------------------------
    def add_pool(self, pool_id: PoolId, num_blocks: int, block_size: int, host_num_blocks: int = 0,
                 disk_num_blocks: int = 0, disk_blocks: Seq[SeedBlock] = ()) -> None:
        """A new pool, with a host tier of `host_num_blocks` and under it a disk tier of
        `disk_num_blocks` slots seeded with `disk_blocks` (what the node's segment file holds:
        docs/tiers.md). All or nothing."""
        if not isinstance(pool_id, str) or not pool_id:
            raise InvalidRequest(f"pool id must be a non-empty string, got {pool_id!r}")
        if pool_id in self._pools:
            raise InvalidRequest(f"pool {pool_id!r} already exists")
        self._pools[pool_id] = build_pool(pool_id, num_blocks, block_size, host_num_blocks, disk_num_blocks,
                                          disk_blocks, self._kv.changes)

    def remove_pool(self, pool_id: PoolId) -> list[SeqId]:
        """Drop a pool with its sequences, pending ops and plan; returns the dropped ids."""
        dropped = _steps.remove_pool(self._pools, self._seqs, self._pool(pool_id))
        self._kv.pool_removed(pool_id)
        return dropped

    def set_draining(self, pool_id: PoolId, draining: bool) -> None:
        self._pool(pool_id).draining = bool(draining)

    # ---- allocation -----------------------------------------------------------------
    def can_allocate(self, pool_id: PoolId, num_tokens: int) -> bool:
        """Whether a fresh (uncached) prompt of `num_tokens` would be admitted now."""
        pool = self._pool(pool_id)
        check_count("num_tokens", num_tokens, 1)
        if pool.draining:
            return False
        needed = -(-num_tokens // pool.block_size)
        return needed <= pool.num_available - self._watermark_blocks(pool)

    def allocate(
        self,
        seq_id: SeqId,
        pool_id: PoolId,
        token_ids: Seq[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: str | None = None,
        num_compute: int | None = None,
        fetch_sources: Seq[PoolId] = (),
    ) -> AllocateResult:
        """Create a sequence for a prompt, reusing prefix-cached full blocks; all or nothing.

        Admission keeps `watermark * num_blocks` blocks in reserve for appends; the last
        prompt block is always computed. `num_tokens` instead of `token_ids`: no hashing.
        `num_compute`: the tokens beyond the cached prefix that get slots now (chunked
        prefill). `fetch_sources`: pools whose cached prefix may be fetched where this pool's
        ends (fetched tokens count as cached). The steps, and why: allocation.py.
        """
        _allocation.check_new_id(self._pools, self._seqs, seq_id)
        pool = self._pool(pool_id)
        q, prompt_len = _allocation.check_request(pool, token_ids, num_tokens, salt, num_compute,
                                                  self.enable_prefix_caching)
        bs = pool.block_size
        hits = (_prefix.collect(self._pools, pool, q, fetch_sources, self.max_unsettled_steps)
                if q is not None else _prefix.NO_HITS)
        num_cached = hits.num_cached * bs
        total = prompt_len
        if num_compute is not None:
            total = min(prompt_len, num_cached + num_compute)
            if q is not None:
                q = q.truncated(total)
        num_new = -(-total // bs) - len(hits.device)
        _allocation.check_room(pool, hits, num_new, self._watermark_blocks(pool))
        seq = _allocation.admit(pool, seq_id, q, hits, total, num_new, salt, prompt_len)
        self._seqs[seq_id] = seq
        return AllocateResult(seq_id, pool_id, tuple(seq.block_table), num_cached,  # type: ignore[arg-type]  # block ids are plain ints (BlockId is a NewType)
                              slot_range(seq.block_table, bs, num_cached, total), seq.version)

    # ---- appends --------------------------------------------------------------------
    def can_append(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        """Whether `append_slots` would succeed for this sequence alone (appends may use
        the watermark reserve; a copy-on-write needs its source's step settled)."""
        seq = self._seq(seq_id)
        check_count("num_new_tokens", num_new_tokens, 1)
        return can_append(self._pools[seq.pool_id], seq, num_new_tokens)

    def append_tokens(
        self,
        seq_ids: Seq[SeqId],
        num_new_tokens: Seq[int],
        token_ids: Seq[int] | None = None,
        *,
        already_written: bool = False,
        num_late: Seq[int] | None = None,
    ) -> AppendOutcome:
        """Add tokens to a batch of sequences (one scheduler step), columnar: sequence i gets
        `num_new_tokens[i]` tokens, `token_ids` all their ids back to back (None: hashing stops
        for them); the last `num_late[i]` ids of item i come later (`resolve_late`). A failing
        item is listed in `failures` and unchanged; the others run in request order.
        `already_written=True` reports tokens the scheduler already wrote into an exclusive
        partial last block. Counts one step per pool touched. How, and why: append.py.
        """
        return append_columns(self._pools, self._seqs, seq_ids, num_new_tokens, token_ids,
                              already_written=already_written, num_late=num_late)

    def resolve_late(
        self, seq_ids: Seq[SeqId], num_token_ids: Seq[int], token_ids: Seq[int]
    ) -> list[tuple[int, CoreError]]:
        """The late ids of earlier appends: sequence i gets the next `num_token_ids[i]` of
        `token_ids` for its tokens that await theirs (all of them at once); a full last block
        is hashed then. Per item: a failed item (unknown sequence, wrong count, a bad id)
        changes nothing and is listed; the others apply in order."""
        return resolve_late_columns(self._pools, self._seqs, seq_ids, num_token_ids, token_ids)

    def append_slots(
        self, requests: Seq[AppendRequest], *, already_written: bool = False
    ) -> list[AppendResult | AppendFailure]:
        """`append_tokens` with one request object per sequence and, per sequence, its new
        tokens' slots, the blocks it gained and its copy-on-write op (what an embedding
        scheduler that drives its workers directly wants)."""
        return append_slots(self._pools, self._seqs, requests, already_written)

    # ---- fork and free --------------------------------------------------------------
    def fork(self, parent: SeqId, child_ids: Seq[SeqId]) -> list[SequenceView]:
        """Children share every block of the parent (ref counts up, nothing copied); the
        first write into a shared partial block triggers copy-on-write."""
        return _allocation.fork(self._pools, self._seqs, self._seq(parent), child_ids)

    def free(self, seq_ids: Seq[SeqId]) -> None:
        """Release sequences. Full hashed blocks that drop to ref_cnt 0 stay cached (the
        sequence's tail is evicted first); other blocks are free at once. All or nothing;
        `PendingWrite` for a sequence with tokens to write in its pool's open step."""
        _allocation.free(self._pools, self._seqs, seq_ids)

    def check_can_free(self, seq_id: SeqId) -> None:
        """`UnknownSequence`, or `PendingWrite` when the sequence has tokens to write in its
        pool's open step (its writes, which forks and prefix hits may share, would never run)."""
        _allocation.check_can_free(self._pools, self._seqs, seq_id)

    # ---- views ----------------------------------------------------------------------
    def get_sequence(self, seq_id: SeqId) -> SequenceView:
        return self._seq(seq_id).view()

    def has_sequence(self, seq_id: SeqId) -> bool:
        """Whether the sequence exists (on device, or swapped out to host)."""
        return seq_id in self._seqs or self._swapped_pool(seq_id) is not None

    def pools_of(self, seq_ids: Seq[SeqId]) -> set[PoolId]:
        """The pools of the known sequences among `seq_ids` (unknown ones are skipped);
        cheap: no view is built (a Step asks this for every sequence it names)."""
        pools = self._one_pool_of(seq_ids)
        if pools is None:
            pools = set(map(_POOL_ID, filter(None, map(self._seqs.get, seq_ids))))
        for pool in self._pools.values():
            if pool.host is not None and pool.host.swapped and not pool.host.swapped.keys().isdisjoint(seq_ids):
                pools.add(pool.pool_id)
        return pools

    def _one_pool_of(self, seq_ids: Seq[SeqId]) -> set[PoolId] | None:
        """`{pool}` when every id names a sequence of the first one's pool (a Step's usual
        case: one scheduler, one node), proved by one C-level superset test of the pool's
        sequences (a third of the cost of looking every id up); None: look them up one by one."""
        if not seq_ids:
            return set()
        first = self._seqs.get(seq_ids[0])
        if first is None:
            return None
        pool_id = first.pool_id
        return {pool_id} if self._pools[pool_id].seqs.keys() >= set(seq_ids) else None

    def get_tables(
        self, seq_ids: Seq[SeqId], known_versions: Mapping[SeqId, int] | None = None
    ) -> list[SequenceView]:
        """Views of the sequences whose table is newer than the caller's version."""
        return newer_views([self._seq(sid) for sid in seq_ids], known_versions or {})

    def sequences(self, pool_id: PoolId | None = None) -> list[SequenceView]:
        if pool_id is None:
            return [s.view() for s in self._seqs.values()]
        return [s.view() for s in self._pool(pool_id).seqs.values()]

    # ---- steps (steps.py) -----------------------------------------------------------
    def open_step_id(self, pool_id: PoolId) -> StepId:
        """The step new work of the pool is recorded in."""
        return self._pool(pool_id).step.step_id

    def settled_step_id(self, pool_id: PoolId) -> int:
        """Every step of the pool up to this one is reported (complete or failed)."""
        return self._pool(pool_id).settled_step

    def unsettled_step_ids(self, pool_id: PoolId) -> list[StepId]:
        """Closed steps whose Forward is not reported yet, oldest first."""
        return [r.step_id for r in self._pool(pool_id).unsettled]

    def writers_since(self, pool_id: PoolId, step_id: int) -> list[SeqId]:
        """The sequences a failure of `step_id` (and later steps) would drop."""
        return [sid for sid, seq in self._pool(pool_id).seqs.items() if seq.last_touched_step >= step_id]

    def abandon_pool(self, pool_id: PoolId) -> list[SeqId]:
        """Hand the pool to a new scheduler: drop every sequence (the old scheduler's), count its
        unsettled steps as failed (their hashes forgotten), abort its plan, and make the next
        step a reset (the node forgets every table of the pool). Returns the dropped ids."""
        return _steps.abandon_pool(self._pools, self._seqs, self._pool(pool_id))

    def can_close_step(self, pool_id: PoolId) -> bool:
        """Whether `close_step` would hand out a step now (it has work and the pool is below
        its limit of unsettled steps)."""
        pool = self._pool(pool_id)
        return pool.step.has_work and len(pool.unsettled) < self.max_unsettled_steps

    def close_step(self, pool_id: PoolId, *, force: bool = False) -> StepOutput | None:
        """Close the pool's open step and hand it to the scheduler (None: it has no work;
        table changes alone wait unless `force`). `StepsUnsettled`, nothing changed, when
        `max_unsettled_steps` closed steps await their report (steps.py)."""
        return _steps.close_step(self._pool(pool_id), self.max_unsettled_steps, force)

    def close_steps(self) -> list[StepOutput]:
        """Close the open step of every pool that has work, in pool order."""
        return [out for pid in list(self._pools) if self.can_close_step(pid) and (out := self.close_step(pid))]

    def settle_steps(self, pool_id: PoolId, completed_up_to: int, failed_from: int | None = None) -> SettleResult:
        """The scheduler's report of its Forwards: every closed step up to `completed_up_to`
        ran; every closed step from `failed_from` on (directly after them) did not. What each
        outcome does: steps.py. Reporting an already settled step again is a no-op."""
        return _steps.settle_steps(self._pools, self._seqs, self._pool(pool_id), completed_up_to, failed_from)

    # ---- host tier: swap preemption (swap.py) -----------------------------------------
    def is_swapped(self, seq_id: SeqId) -> bool:
        return seq_id not in self._seqs and self._swapped_pool(seq_id) is not None

    def swapped_ids(self, pool_id: PoolId | None = None) -> list[SeqId]:
        pools = [self._pool(pool_id)] if pool_id is not None else list(self._pools.values())
        return [sid for p in pools if p.host is not None for sid in p.host.swapped]

    def can_swap_out(self, seq_ids: Seq[SeqId]) -> bool:
        """Whether `swap_out` would succeed now (host room, no writes pending in the open step)."""
        try:
            _swap.check_swap_out(self._pools, self._seqs, list(seq_ids))
        except CoreError:
            return False
        return True

    def swap_out(self, seq_ids: Seq[SeqId]) -> None:
        """Preempt sequences to their pool's host tier (swap.py); all or nothing: `OutOfBlocks`
        when the host tier lacks room (the scheduler falls back to recompute), `PendingWrite`
        when a sequence has writes in the open step."""
        _swap.swap_out(self._pools, self._seqs, list(seq_ids))

    def can_swap_in(self, seq_ids: Seq[SeqId]) -> bool:
        try:
            _swap.check_swap_in(self._pools, self._seqs, list(seq_ids), self.watermark)
        except CoreError:
            return False
        return True

    def swap_in(self, seq_ids: Seq[SeqId]) -> list[SequenceView]:
        """Resume swapped-out sequences on device, their tables announced anew in the open step
        (swap.py); all or nothing: `PendingWrite` while the swap-out's step is unreported,
        `OutOfBlocks` above the watermark."""
        return _swap.swap_in(self._pools, self._seqs, list(seq_ids), self.watermark)

    # ---- prefix cache (prefix.py) -----------------------------------------------------
    def route(
        self, token_ids: Seq[int], salt: str | None = None, fetch_sources: Seq[PoolId] | None = None,
    ) -> list[RouteEntry]:
        """Pools that admit new sequences, best first by the fetch cost model, then most
        free-or-evictable blocks, then pool id (prefix.py). Per pool: its local prefix tokens,
        the tokens it could fetch beyond them from the best other pool among `fetch_sources`
        (None: every pool, draining ones included) and the rest."""
        tokens = token_array(token_ids)
        if not tokens:
            raise InvalidRequest("empty prompt")
        return _prefix.route(self._pools, tokens, salt, fetch_sources, self.enable_prefix_caching,
                             self.max_unsettled_steps)

    def is_lending(self, pool_id: PoolId) -> bool:
        """Whether the pool's open step carries serve grants (prefix fetch): it must be closed
        and handed to its node with the step whose fetches they serve."""
        return bool(self._pool(pool_id).step.serves)

    def fetch_counts(self, pool_id: PoolId) -> tuple[int, int]:
        """(blocks this pool fetched from others, blocks it lends now) — prefix fetch gauges."""
        pool = self._pool(pool_id)
        return pool.fetched_blocks, sum(len(loan.blocks) for loan in pool.lent.values())

    def evict(self, pool_id: PoolId, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks (LRU); returns how many were evicted."""
        pool = self._pool(pool_id)
        check_count("num_blocks", num_blocks, 0)
        return pool.evict(num_blocks)

    def reset_prefix_cache(self, pool_id: PoolId | None = None) -> int:
        """Forget all content hashes (of one pool or all); cached blocks become free.
        Returns the number of cached blocks dropped."""
        pools = [self._pool(pool_id)] if pool_id is not None else list(self._pools.values())
        return sum(p.reset_prefix_cache() for p in pools)

    # ---- defragmentation (defrag.py) ----------------------------------------------------
    def plan_defrag(
        self, pool_id: PoolId, kind: DefragKind = "compaction", max_moves: int | None = None
    ) -> DefragPlan | None:
        """Reserve destinations and queue the copies of a defrag plan in the pool's open step
        (None: nothing to do). Only full blocks whose writing step is settled move; the plan
        commits when the step carrying its moves is settled (`settle_steps`) and aborts when
        that step fails. See `block_manager.core.defrag` for the algorithms."""
        plan = _defrag.make_plan(self._pool(pool_id), PlanId(self._next_plan_id), kind, max_moves)
        if plan is not None:
            self._next_plan_id += 1
        return plan

    def abort_defrag(self, plan_id: PlanId) -> None:
        """Roll a plan back: destinations return to the free queue, sources are unpinned.
        The moves may still run in their step's Forward: harmless, since a released
        destination's next owner writes only in a later step (after that step's copies)."""
        _defrag.abort(_defrag.plan_pool(self._pools, plan_id))

    def get_defrag_plan(self, pool_id: PoolId) -> DefragPlan | None:
        pool = self._pool(pool_id)
        if pool.plan is None:
            return None
        p = pool.plan
        return DefragPlan(p.plan_id, pool_id, p.kind, tuple(p.moves), p.step_id)

    def defrag_due(self, pool_id: PoolId) -> DefragKind | None:
        """Which defragmentation the policy asks for now ("compaction"/"contiguity"), or
        None. Pure query: it changes nothing."""
        return _defrag.due(self._pool(pool_id), self.defrag_policy)

    # ---- metrics, fsck, snapshots ---------------------------------------------------
    def free_blocks(self, pool_id: PoolId) -> tuple[int, int]:
        """(free, usable: free, evictable, or held by a defrag plan no node has yet, which an
        allocation or swap-in that needs them aborts) blocks of a pool: a scheduler's gauges."""
        pool = self._pool(pool_id)
        return pool.num_free, _prefix.usable_blocks(pool)

    def metrics(self, pool_id: PoolId) -> PoolMetrics:
        return _metrics.pool_metrics(self._pool(pool_id))

    def host_metrics(self, pool_id: PoolId) -> HostTierMetrics | None:
        """The pool's host tier counters and gauges (None: the pool has no host tier)."""
        return _metrics.host_metrics(self._pool(pool_id))

    def disk_metrics(self, pool_id: PoolId) -> DiskTierMetrics | None:
        """The pool's disk tier counters and gauges (None: the pool has no disk tier)."""
        return _metrics.disk_metrics(self._pool(pool_id))

    def fsck(self) -> list[str]:
        """Check every invariant; human-readable violations, empty when healthy."""
        return fsck(self._pools, self._seqs, self._next_plan_id)

    def to_snapshot(self) -> dict[str, Any]:
        """The complete state as a JSON-serialisable dict (see core/snapshot.py)."""
        return to_snapshot(CoreParts(self.watermark, self.enable_prefix_caching, self.defrag_policy, self._pools,
                                     self._seqs, self._next_plan_id, self.max_unsettled_steps))

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any]) -> BlockManager:
        """Rebuild a manager from `to_snapshot()` output; InvalidRequest if malformed or if
        the decoded state fails fsck."""
        parts = from_snapshot(data)
        manager = cls(
            watermark=parts.watermark,
            enable_prefix_caching=parts.enable_prefix_caching,
            defrag_policy=parts.defrag_policy,
            max_unsettled_steps=parts.max_unsettled_steps,
        )
        manager._pools, manager._seqs, manager._next_plan_id = parts.pools, parts.seqs, parts.next_plan_id
        problems = manager.fsck()
        if problems:
            raise InvalidRequest(f"snapshot fails fsck: {problems[:5]}")
        return manager


__all__ = ["BlockManager", "BlockId", "MAX_POOL_BLOCKS"]
