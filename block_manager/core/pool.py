"""One pool's blocks: reference counts, the free and cached queues, the prefix index, which
step last wrote each block, and the pool's open and unsettled steps (see `steps.py`).

Eviction order is kept in two intrusive lists that together form the vLLM-style free
queue: `free_list` (never-hashed blocks; freed ones are pushed at the front and reused
first) followed by `cached_list` (ref_cnt 0 but hashed, least recently freed first).
Allocation pops the free list and only then evicts from the front of the cached list,
so a cached block is only ever given up when no plain free block is left. Keeping the
two apart also makes `evict(n)` O(n) instead of skipping over free blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from block_manager.core import kv_events as _kv_events
from block_manager.core.block_tier import BlockMeta, TierLedger
from block_manager.core.disk_tier import DiskTier, SeedBlock, seed
from block_manager.core.errors import InvalidRequest, check_count
from block_manager.core.fetch import Loan
from block_manager.core.hashing import BlockHash
from block_manager.core.sequence import SeqColumns, Sequence
from block_manager.core.step_work import StepRecord, StepWork
from block_manager.core.tiers import HostTier, TierKind, TierOp
from block_manager.core.types import BlockId, CopyKind, CopyOp, DefragKind, PlanId, PoolId, SeqId, StepId

MAX_POOL_BLOCKS = 1 << 24  # bounds memory for a pool created from bad input


@dataclass(slots=True)
class PlanState:
    """An outstanding defrag plan: destinations reserved, sources pinned."""

    plan_id: PlanId
    kind: DefragKind
    moves: list[CopyOp]
    step_id: StepId          # the step whose Forward runs the moves; the plan commits once it is settled


class Pool(TierLedger):
    """Bookkeeping of one compute node's blocks — the device tier, with the host tier under
    it; the manager orchestrates, the pool keeps its own counters consistent on every
    transition."""

    __slots__ = (
        "pool_id", "block_size", "draining", "reserved", "pinned", "num_used",
        "num_reserved", "seqs", "next_op_id", "plan", "step", "unsettled",
        "settled_step", "num_steps", "last_defrag_step", "prefix_query_tokens", "prefix_hit_tokens",
        "cow_copies", "evictions", "defrag_moves", "compaction_plans", "contiguity_plans", "aborted_plans",
        "last_version", "cols", "ref_np", "write_step_np", "host", "lent", "fetched_blocks",
    )

    ref_cnt: array
    write_step: array

    def __init__(self, pool_id: PoolId, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        self.pool_id = pool_id
        self.block_size = block_size
        self.draining = False
        # Flat int64 arrays: per-item code indexes them like lists, the batched append reads
        # and writes the same memory through the numpy views (`ref_np`, `write_step_np`).
        self.ref_cnt = array("q", bytes(8 * num_blocks))
        # reserved: a defrag destination, or a pinned source whose last reference went
        # away while the plan was outstanding (held until commit/abort, never reused).
        self.reserved = bytearray(num_blocks)
        self.pinned = bytearray(num_blocks)
        self.num_used = 0
        self.num_reserved = 0
        self.seqs: dict[SeqId, Sequence] = {}
        self.cols = SeqColumns(block_size)
        self.next_op_id = 1
        # Table versions come from one counter per pool, so a sequence id that is freed and
        # allocated again never reuses a version a compute node may still have cached.
        self.last_version = 0
        self.plan: PlanState | None = None
        # The step that last assigned a slot in each block (0: none since the pool began);
        # a block holds its K/V once that step is settled (see steps.py).
        self.write_step = array("q", bytes(8 * num_blocks))
        self.refresh_views()
        self.step = StepWork(StepId(1))
        self.unsettled: list[StepRecord] = []
        self.settled_step = 0
        self.num_steps = 0
        self.last_defrag_step = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.cow_copies = 0
        self.evictions = 0
        self.defrag_moves = 0
        self.compaction_plans = 0   # committed plans by kind, and plans aborted
        self.contiguity_plans = 0
        self.aborted_plans = 0
        self.host: HostTier | None = None   # the host tier under the pool (tiers.py), if any
        self.lent: dict[str, Loan] = {}   # blocks pinned for other pools' fetches (fetch.py), by fetch id
        self.fetched_blocks = 0           # blocks this pool got by a fetch instead of a recompute

    def refresh_views(self) -> None:
        """(Re)bind the numpy views after `ref_cnt` or `write_step` was replaced."""
        self.ref_np = np.frombuffer(self.ref_cnt, dtype=np.int64)
        self.write_step_np = np.frombuffer(self.write_step, dtype=np.int64)

    def new_version(self) -> int:
        self.last_version += 1
        return self.last_version

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    # ---- block transitions ----------------------------------------------------------
    def take_block(self) -> int:
        """Pop a block for a new owner (ref_cnt 1), evicting the LRU cached block if no
        free one is left. The caller has checked `num_available`."""
        b = self.free_list.pop_front()
        if b is None:
            b = self.cached_list.pop_front()
            if b is None:
                raise InvalidRequest("internal: take_block on an exhausted pool")
            if self.host is not None:
                self.offload(b)   # keeps the content on host when there is room
            self.drop_hash(b)
            self.evictions += 1
        self.ref_cnt[b] = 1
        self.num_used += 1
        return b

    def take_free_many(self, n: int) -> list[int]:
        """`n` plain free blocks for new owners at once, in the order `take_block` would give
        them (the caller checked `n <= free_list.length`: no eviction)."""
        blocks = self.free_list.pop_front_many(n, self.ref_cnt)
        self.num_used += n
        return blocks

    def share_block(self, b: int) -> None:
        """One more table holds `b` (a prefix hit or a fork); a cached block leaves the
        eviction queue in O(1)."""
        if self.ref_cnt[b] == 0:
            self.cached_list.remove(b)
            self.num_used += 1
        self.ref_cnt[b] += 1

    def release_block(self, b: int) -> None:
        """One table fewer holds `b`; at zero it becomes cached (hashed), free, or — when
        it is the source of an outstanding defrag move — held by the plan."""
        cnt = self.ref_cnt[b] - 1
        self.ref_cnt[b] = cnt
        if cnt:
            return
        self.num_used -= 1
        if self.pinned[b]:
            self.drop_hash(b)
            self.reserved[b] = 1
            self.num_reserved += 1
        elif self.meta[b] is not None:
            self.cached_list.push_back(b)
        else:
            self.free_list.push_front(b)

    # ---- prefix index ---------------------------------------------------------------
    def register(
        self, b: int, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
        token_ids: tuple[int, ...],
    ) -> bool:
        """Make full block `b` findable by its hash; whether it was registered. The first
        block with a given hash keeps it; a later duplicate stays anonymous (freed to the
        front, reused first)."""
        if block_hash in self.prefix_index or self.meta[b] is not None:
            return False
        self.index(b, BlockMeta(block_hash, parent, salt, token_ids))
        return True

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks, least recently freed first (to the host tier
        when there is one and it has room)."""
        n = 0
        while n < num_blocks:
            b = self.cached_list.pop_front()
            if b is None:
                break
            if self.host is not None:
                self.offload(b)
            self.drop_hash(b)
            self.free_list.push_back(b)
            self.evictions += 1
            n += 1
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every hash; cached blocks become plain free blocks. Returns how many
        cached blocks were dropped."""
        n = 0
        while True:
            b = self.cached_list.pop_front()
            if b is None:
                break
            self.free_list.push_back(b)
            n += 1
        for b in list(self.prefix_index.values()):
            self.meta[b] = None
        if self.prefix_index and self.kv_log is not None:
            self.kv_log.cleared()
        self.prefix_index.clear()
        return n

    def unregister(self, b: int, block_hash: bytes) -> None:
        """Forget that `b` holds `block_hash` (its writing step failed): it must never be a
        prefix hit. A cached block without a hash is a plain free block."""
        if self.prefix_index.get(block_hash) != b:
            return  # evicted or re-registered since: not this registration any more
        self.forget(b)   # (a reserved block is never in the cached queue)

    # ---- steps and copy ops ---------------------------------------------------------
    def written(self, b: int) -> bool:
        """Whether the Forward of every step that assigned slots in `b` is known complete."""
        return self.write_step[b] <= self.settled_step

    def add_copy_op(self, src: int, dst: int, kind: CopyKind) -> CopyOp:
        """Queue a copy in the open step (it runs before the step's writes)."""
        op = CopyOp(self.next_op_id, BlockId(src), BlockId(dst), kind)
        self.next_op_id += 1
        self.step.copy_ops.append(op)
        return op

    @property
    def last_closed_step(self) -> int:
        return self.step.step_id - 1

    # ---- the tiers under the pool (tiers.py, disk_tier.py) ------------------------------
    def queue_tier_op(self, kind: TierKind, src: int, dst: int, meta: BlockMeta | None = None) -> TierOp:
        """Queue a move between tiers in the open step (the node runs them before its copies)."""
        op = TierOp(self.next_op_id, kind, BlockId(src), BlockId(dst), meta)
        self.next_op_id += 1
        self.step.tier_ops.append(op)
        return op

    def offload(self, b: int) -> None:
        """Device block `b` (cached, hashed) is being evicted: keep its content on host when the
        host tier has room and does not hold that hash yet. Called before `b` loses its hash."""
        host = self.host
        meta = self.meta[b]
        if host is None or meta is None or meta.block_hash in host.prefix_index or not self.written(b):
            return
        h = host.offload(meta, self.step.step_id)
        if h is not None:
            self.queue_tier_op("offload", b, h)

    def attach_disk(self, disk: DiskTier) -> None:
        """Put `disk` under the pool's host tier: host LRU evictions spill to it from now on."""
        if self.host is None:
            raise InvalidRequest(f"pool {self.pool_id!r}: a disk tier needs a host tier above it")
        self.host.disk = disk
        self.host.on_evict = self.spill

    def spill(self, h: int) -> None:
        """Host block `h` (cached, hashed) is being evicted: keep it on disk when it is written
        (disk_tier.py). Called before `h` loses its hash."""
        host = self.host
        if host is None or host.disk is None:   # only attach_disk installs this hook
            raise InvalidRequest(f"internal: pool {self.pool_id!r} spills without a disk tier")
        meta = host.meta[h]
        if meta is None or not host.written(h, self.settled_step):
            return
        s = host.disk.spill(meta, self.settled_step, self.step.step_id)
        if s is not None:
            self.queue_tier_op("disk_offload", h, s, meta)

    # ---- gauges ---------------------------------------------------------------------
    def high_water_mark(self) -> int:
        """1 + the highest id of a block with ref_cnt > 0 (0 when none is used)."""
        used = np.flatnonzero(self.ref_np)
        return int(used[-1]) + 1 if len(used) else 0


class FreeRun:
    """A batch's block takes, served in request order from blocks popped off the free list up
    front (`expected` of them, at most what the free list holds) and then from `take_block`.

    The blocks come out exactly as successive `take_block` calls would give them, provided
    nothing puts a block back on the free list while the run is open: the batched append only
    releases copy-on-write sources, which another table still holds. `close` puts what was not
    used back at the front, in order, as if it had never been taken. `available` is what
    `num_available` would say without the run."""

    __slots__ = ("pool", "blocks", "pos")

    def __init__(self, pool: Pool, expected: int) -> None:
        self.pool = pool
        self.blocks = pool.take_free_many(min(expected, pool.free_list.length))
        self.pos = 0

    @property
    def available(self) -> int:
        return self.pool.num_available + len(self.blocks) - self.pos

    def take(self) -> int:
        if self.pos < len(self.blocks):
            b: int = self.blocks[self.pos]
            self.pos += 1
            return b
        return self.pool.take_block()

    def close(self) -> None:
        left = self.blocks[self.pos:]
        self.blocks = []
        self.pos = 0
        if left:
            pool = self.pool
            pool.free_list.push_front_many(left, pool.ref_cnt)
            pool.num_used -= len(left)


def _check_geometry(num_blocks: int, block_size: int, host_num_blocks: int, disk_num_blocks: int,
                    disk_blocks: Seq[SeedBlock]) -> None:
    check_count("num_blocks", num_blocks, 1)
    check_count("block_size", block_size, 1)
    if num_blocks > MAX_POOL_BLOCKS:
        raise InvalidRequest(f"num_blocks {num_blocks} exceeds {MAX_POOL_BLOCKS}")
    check_count("host_num_blocks", host_num_blocks, 0)
    if host_num_blocks > MAX_POOL_BLOCKS:
        raise InvalidRequest(f"host_num_blocks {host_num_blocks} exceeds {MAX_POOL_BLOCKS}")
    check_count("disk_num_blocks", disk_num_blocks, 0)
    if disk_num_blocks > MAX_POOL_BLOCKS:
        raise InvalidRequest(f"disk_num_blocks {disk_num_blocks} exceeds {MAX_POOL_BLOCKS}")
    if disk_num_blocks and not host_num_blocks:
        raise InvalidRequest("a disk tier needs a host tier above it (host_num_blocks > 0)")
    if disk_blocks and not disk_num_blocks:
        raise InvalidRequest("disk blocks given for a pool without a disk tier")


def build_pool(pool_id: PoolId, num_blocks: int, block_size: int, host_num_blocks: int, disk_num_blocks: int,
               disk_blocks: Seq[SeedBlock], kv_changes: list[_kv_events.KvChange] | None) -> Pool:
    """A new pool with its tiers (`BlockManager.add_pool`), its index changes recorded into
    `kv_changes` when that is a list; `InvalidRequest` for bad sizes or seeds."""
    _check_geometry(num_blocks, block_size, host_num_blocks, disk_num_blocks, disk_blocks)
    pool = Pool(pool_id, num_blocks, block_size)
    if host_num_blocks:
        pool.host = HostTier(host_num_blocks)
    if disk_num_blocks:
        pool.attach_disk(DiskTier(disk_num_blocks))
    if kv_changes is not None:
        _kv_events.attach(pool, kv_changes)
    if pool.host is not None and pool.host.disk is not None:   # seeds are disk-tier events:
        seed(pool.host.disk, disk_blocks, block_size)          # malformed ones raise here
    return pool
