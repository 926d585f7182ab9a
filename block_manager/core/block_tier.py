"""The contract every tier of a pool's blocks keeps, and the parts the three tiers share.

A pool's blocks live in up to three tiers, each its own id space: the device pool (`Pool`,
pool.py), the host tier under it (`HostTier`, tiers.py) and the disk tier under that
(`DiskTier`, disk_tier.py). Each keeps the same ledger — reference counts, a free queue, an
LRU queue of cached (hashed, unreferenced) blocks, a prefix index confirmed against each
block's identity (`BlockMeta`), the step that last wrote each block — and tells its
`kv_log` about every index change (kv_events.py). `BlockTier` is that contract;
`TierLedger` implements the part that is the same in all three (lookup, hash bookkeeping,
forgetting a failed step's blocks), `LowerTier` adds what the host and disk tiers share and
the device pool does not: blocks held by the steps that read them, and counters.

Why the device pool keeps its own `take_block`/`release_block`: it counts used, reserved and
pinned blocks for defrag and is the hot path of every append, while a lower tier's block
is only ever taken by a tier move.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from typing import Any, ClassVar, NamedTuple, Protocol

from block_manager.core.block_list import BlockList
from block_manager.core.hashing import BlockHash
from block_manager.core.kv_events import KvChangeLog


class BlockMeta(NamedTuple):
    """Identity of a hashed block: what a prefix hit is confirmed against.

    A named tuple, not an object with slots (issue 45): one is built per filled block on the
    append hot path and the prefix index keeps millions of them. Its fields are bytes, None,
    a str and a tuple of ints, so the garbage collector untracks it after its first pass
    instead of traversing every cached block's identity in each full collection (a cost that
    grows with the index, paid by every step that triggers one). Never mutated."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    salt: str | None
    token_ids: tuple[int, ...]


class BlockTier(Protocol):
    """What the prefix chain, the KV events and fsck read of any tier (device, host, disk)."""

    num_blocks: int
    free_list: BlockList
    cached_list: BlockList
    meta: list[BlockMeta | None]
    prefix_index: dict[BlockHash, int]
    kv_log: KvChangeLog | None

    @property
    def num_available(self) -> int: ...

    def lookup(self, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
               token_ids: tuple[int, ...]) -> int | None: ...

    def drop_hash(self, b: int) -> None: ...

    def forget(self, b: int) -> None: ...


class TierLedger:
    """The ledger every tier keeps (see the module docstring); subclasses own the transitions."""

    __slots__ = ("num_blocks", "ref_cnt", "write_step", "free_list", "cached_list", "meta", "prefix_index",
                 "kv_log")

    ref_cnt: MutableSequence[int]
    write_step: MutableSequence[int]

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_list = BlockList(num_blocks)
        self.cached_list = BlockList(num_blocks)
        for b in range(num_blocks):
            self.free_list.push_back(b)
        self.meta: list[BlockMeta | None] = [None] * num_blocks
        self.prefix_index: dict[BlockHash, int] = {}
        self.kv_log: KvChangeLog | None = None   # set while index changes are recorded (kv_events.py)

    @property
    def num_available(self) -> int:
        """Blocks a new owner can take now: free plus evictable cached ones."""
        return self.free_list.length + self.cached_list.length

    @property
    def num_cached(self) -> int:
        return self.cached_list.length

    def lookup(self, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
               token_ids: tuple[int, ...]) -> int | None:
        """The block holding exactly this content, confirmed against the stored identity (a
        hash alone could collide across salts or parents)."""
        b = self.prefix_index.get(block_hash)
        if b is None:
            return None
        m = self.meta[b]
        if m is None or m.token_ids != token_ids or m.parent_hash != parent or m.salt != salt:
            return None
        return b

    def index(self, b: int, meta: BlockMeta) -> None:
        """Block `b` holds `meta`'s content: findable by its hash from now on."""
        self.meta[b] = meta
        self.prefix_index[meta.block_hash] = b
        if self.kv_log is not None:
            self.kv_log.stored(meta)

    def drop_hash(self, b: int) -> None:
        """`b` is no longer findable by its hash (evicted, overwritten or forgotten)."""
        m = self.meta[b]
        if m is not None:
            del self.prefix_index[m.block_hash]
            self.meta[b] = None
            if self.kv_log is not None:
                self.kv_log.removed(m.block_hash)

    def forget(self, b: int) -> None:
        """`b`'s content is not what its hash says (its writing step failed): it must never
        be a hit again, and unreferenced it is a plain free block, reused first."""
        self.drop_hash(b)
        if self.ref_cnt[b] == 0 and b in self.cached_list:
            self.cached_list.remove(b)
            self.free_list.push_front(b)

    def hashed_to_list(self) -> list[list[Any]]:
        """The hashed blocks for a snapshot: [block, hash, parent, salt, tokens] (hex hashes)."""
        return [[b, m.block_hash.hex(), None if m.parent_hash is None else m.parent_hash.hex(), m.salt,
                 list(m.token_ids)] for b, m in enumerate(self.meta) if m is not None]


def meta_from_list(h: str, parent: str | None, salt: str | None, tokens: list[Any]) -> BlockMeta:
    """One `hashed_to_list` entry's identity back."""
    return BlockMeta(bytes.fromhex(h), None if parent is None else bytes.fromhex(parent), salt,
                     tuple(int(t) for t in tokens))


class LowerTier(TierLedger):
    """A host or disk tier: its blocks are referenced by the steps that read them (*holds*,
    released when the step is reported) and, on host, by swapped-out sequences; a block is
    written once the step carrying its move is reported complete."""

    __slots__ = ("holds",)

    COUNTERS: ClassVar[tuple[str, ...]] = ()
    KIND: ClassVar[str] = "tier"   # how snapshot errors name the tier

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.ref_cnt = [0] * num_blocks
        self.write_step = [0] * num_blocks
        self.holds: list[tuple[int, int]] = []   # (step id, block) read by that step
        for name in self.COUNTERS:
            setattr(self, name, 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def written(self, b: int, settled_step: int) -> bool:
        return self.write_step[b] <= settled_step

    def share(self, b: int) -> None:
        """One more holder of `b`; a cached block leaves the LRU queue."""
        if self.ref_cnt[b] == 0:
            self.cached_list.remove(b)
        self.ref_cnt[b] += 1

    def hold(self, b: int, step_id: int) -> None:
        """`b` is read by step `step_id`: it stays put until that step is reported."""
        self.share(b)
        self.holds.append((step_id, b))

    def release(self, b: int) -> None:
        """One holder fewer; at zero `b` is cached (hashed) or free."""
        cnt = self.ref_cnt[b] - 1
        self.ref_cnt[b] = cnt
        if cnt:
            return
        if self.meta[b] is not None:
            self.cached_list.push_back(b)
        else:
            self.free_list.push_front(b)

    def release_holds(self, settled_step: int) -> None:
        """Steps up to `settled_step` are reported: the blocks they read are free to go."""
        if not self.holds:
            return
        keep: list[tuple[int, int]] = []
        for step_id, b in self.holds:
            if step_id <= settled_step:
                self.release(b)
            else:
                keep.append((step_id, b))
        self.holds = keep

    def forget_written(self, failed_from: int, last_closed: int) -> None:
        """Steps `failed_from … last_closed` failed: the blocks they moved into this tier were
        never written; their hashes are forgotten."""
        for b in range(self.num_blocks):
            if failed_from <= self.write_step[b] <= last_closed and self.meta[b] is not None:
                self.forget(b)

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.COUNTERS}

    # ---- snapshot -----------------------------------------------------------------------
    def ledger_to_dict(self) -> dict[str, Any]:
        return {
            "free_list": list(self.free_list),
            "cached_list": list(self.cached_list),
            "hashed_blocks": self.hashed_to_list(),
            "write_step": [[b, ws] for b, ws in enumerate(self.write_step) if ws],
            "holds": [list(h) for h in self.holds],
        }

    def ledger_from_dict(self, d: dict[str, Any]) -> None:
        """Restore what `ledger_to_dict` wrote into this fresh tier (its counters too);
        `ValueError` for a malformed one. Reference counts are the caller's."""
        n, kind = self.num_blocks, self.KIND
        while self.free_list.pop_front() is not None:
            pass
        for name, lst in (("free_list", self.free_list), ("cached_list", self.cached_list)):
            for b in d[name]:
                if type(b) is not int or not 0 <= b < n or b in self.free_list or b in self.cached_list:
                    raise ValueError(f"{kind} {name}: bad or repeated block {b!r}")
                lst.push_back(b)
        for b, h, parent, salt, tokens in d["hashed_blocks"]:
            meta = meta_from_list(h, parent, salt, tokens)
            if meta.block_hash in self.prefix_index or not 0 <= b < n:
                raise ValueError(f"{kind}: two blocks with one hash, or a bad block")
            self.meta[b] = meta
            self.prefix_index[meta.block_hash] = int(b)
        for b, ws in d["write_step"]:
            self.write_step[int(b)] = int(ws)
        self.holds = [(int(s), int(b)) for s, b in d["holds"]]
        for name in self.COUNTERS:
            setattr(self, name, int(d["counters"][name]))


def check_num_blocks(d: dict[str, Any], max_blocks: int, kind: str) -> int:
    n = d["num_blocks"]
    if type(n) is not int or not 1 <= n <= max_blocks:
        raise ValueError(f"{kind} num_blocks {n!r}")
    return n


__all__ = ["BlockMeta", "BlockTier", "LowerTier", "TierLedger", "check_num_blocks", "meta_from_list"]
