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
from dataclasses import dataclass

from block_manager.core.block_list import BlockList
from block_manager.core.errors import InvalidRequest
from block_manager.core.hashing import BlockHash

from .sequence import Sequence
from .steps import StepRecord, StepWork
from .types import BlockId, CopyKind, CopyOp, DefragKind, PlanId, PoolId, SeqId, StepId

MAX_POOL_BLOCKS = 1 << 24  # bounds memory for a pool created from bad input


@dataclass(slots=True)
class BlockMeta:
    """Identity of a hashed block: what a prefix hit is confirmed against.

    Not frozen (one is built per filled block on the append hot path); never mutated."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    salt: str | None
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class PlanState:
    """An outstanding defrag plan: destinations reserved, sources pinned."""

    plan_id: PlanId
    kind: DefragKind
    moves: list[CopyOp]
    step_id: StepId          # the step whose Forward runs the moves; the plan commits once it is settled


class Pool:
    """Bookkeeping of one compute node's blocks; the manager orchestrates, the pool keeps
    its own counters consistent on every transition."""

    __slots__ = (
        "pool_id", "num_blocks", "block_size", "draining", "ref_cnt", "free_list",
        "cached_list", "meta", "prefix_index", "reserved", "pinned", "num_used",
        "num_reserved", "seqs", "next_op_id", "plan", "write_step", "step", "unsettled",
        "settled_step", "num_steps", "last_defrag_step", "prefix_query_tokens", "prefix_hit_tokens",
        "cow_copies", "evictions", "defrag_moves", "compaction_plans", "contiguity_plans", "aborted_plans",
        "last_version",
    )

    def __init__(self, pool_id: PoolId, num_blocks: int, block_size: int) -> None:
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.draining = False
        self.ref_cnt = [0] * num_blocks
        self.free_list = BlockList(num_blocks)
        self.cached_list = BlockList(num_blocks)
        for b in range(num_blocks):
            self.free_list.push_back(b)
        self.meta: list[BlockMeta | None] = [None] * num_blocks
        self.prefix_index: dict[BlockHash, int] = {}
        # reserved: a defrag destination, or a pinned source whose last reference went
        # away while the plan was outstanding (held until commit/abort, never reused).
        self.reserved = bytearray(num_blocks)
        self.pinned = bytearray(num_blocks)
        self.num_used = 0
        self.num_reserved = 0
        self.seqs: dict[SeqId, Sequence] = {}
        self.next_op_id = 1
        # Table versions come from one counter per pool, so a sequence id that is freed and
        # allocated again never reuses a version a compute node may still have cached.
        self.last_version = 0
        self.plan: PlanState | None = None
        # The step that last assigned a slot in each block (0: none since the pool began);
        # a block holds its K/V once that step is settled (see steps.py).
        self.write_step = array("q", bytes(8 * num_blocks))
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

    def new_version(self) -> int:
        self.last_version += 1
        return self.last_version

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_cached(self) -> int:
        return len(self.cached_list)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return self.free_list.length + self.cached_list.length

    # ---- block transitions ----------------------------------------------------------
    def take_block(self) -> int:
        """Pop a block for a new owner (ref_cnt 1), evicting the LRU cached block if no
        free one is left. The caller has checked `num_available`."""
        b = self.free_list.pop_front()
        if b is None:
            b = self.cached_list.pop_front()
            if b is None:
                raise InvalidRequest("internal: take_block on an exhausted pool")
            self.drop_hash(b)
            self.evictions += 1
        self.ref_cnt[b] = 1
        self.num_used += 1
        return b

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
    def lookup(
        self, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
        token_ids: tuple[int, ...],
    ) -> int | None:
        """Block holding exactly this content, confirmed against the stored tokens."""
        b = self.prefix_index.get(block_hash)
        if b is None:
            return None
        m = self.meta[b]
        if m is None or m.token_ids != token_ids or m.parent_hash != parent or m.salt != salt:
            return None
        return b

    def register(
        self, b: int, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
        token_ids: tuple[int, ...],
    ) -> bool:
        """Make full block `b` findable by its hash; whether it was registered. The first
        block with a given hash keeps it; a later duplicate stays anonymous (freed to the
        front, reused first)."""
        if block_hash in self.prefix_index or self.meta[b] is not None:
            return False
        self.prefix_index[block_hash] = b
        self.meta[b] = BlockMeta(block_hash, parent, salt, token_ids)
        return True

    def drop_hash(self, b: int) -> None:
        m = self.meta[b]
        if m is not None:
            del self.prefix_index[m.block_hash]
            self.meta[b] = None

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks, least recently freed first."""
        n = 0
        while n < num_blocks:
            b = self.cached_list.pop_front()
            if b is None:
                break
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
        self.prefix_index.clear()
        return n

    def unregister(self, b: int, block_hash: bytes) -> None:
        """Forget that `b` holds `block_hash` (its writing step failed): it must never be a
        prefix hit. A cached block without a hash is a plain free block."""
        if self.prefix_index.get(block_hash) != b:
            return  # evicted or re-registered since: not this registration any more
        self.drop_hash(b)
        if self.ref_cnt[b] == 0 and not self.reserved[b] and b in self.cached_list:
            self.cached_list.remove(b)
            self.free_list.push_front(b)

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

    # ---- gauges ---------------------------------------------------------------------
    def high_water_mark(self) -> int:
        """1 + the highest id of a block with ref_cnt > 0 (0 when none is used)."""
        ref = self.ref_cnt
        for b in range(self.num_blocks - 1, -1, -1):
            if ref[b]:
                return b + 1
        return 0
