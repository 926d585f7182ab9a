"""The disk tier of a pool: the compute node's disk slots under its host tier (docs/tiers.md).

The block manager keeps the bookkeeping, the node the bytes (`compute_node/disk_tier.py`).
Disk slot ids are their own id space (`0 … disk_num_blocks-1`: a slot of the node's segment
file). A disk slot only ever holds a *cached* prefix block (hashed, with the tokens, parent
hash and salt a hit is confirmed against): no sequence owns disk blocks, swapped-out
sequences stay on host. So the ledger is a free queue, an LRU queue of cached slots, a prefix
index, the step that last wrote each slot, and *holds* — the steps that read a slot, released
when the step is reported (like the host tier's).

Two moves, ops of the open step next to the host tier's (`tiers.TierOp`):
- `disk_offload` (host block → disk slot): the host tier's LRU eviction of a written, hashed
  block spills it to disk instead of dropping it (`spill`, the host tier's `on_evict` hook);
  when the disk is full the LRU cached slot is overwritten (dropped for good).
- `disk_onboard` (disk slot → host block): a prompt's prefix continuing past the device and
  host hits onto disk slots is staged into fresh host blocks, then onboarded host → device in
  the same step (`stage`).
The node runs a step's moves in this order: host→disk, device→host, disk→host, host→device.
Why it is safe: the host blocks spilled were written by settled steps and are read before
anything of the step writes host memory; a slot read by a step is held until that step is
reported, so no spill (same step or a later one in flight) can overwrite it; a slot is only a
hit once the step that wrote it is reported complete. A step reported failed forgets the
hashes of the slots it wrote.

The node re-reports the slots its segment file holds when it registers (a new epoch after a
restart): `seed` fills a new pool's disk index from them (the node validated every checksum).

Every change of the disk index (a spill into a slot, `seed`, `drop_hash` — an overwritten LRU
slot, a failed step's forgotten slot) tells the tier's `kv_log` when changes are recorded
(core/kv_events.py): the KV events stream's tier "disk".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from block_manager.core.block_list import BlockList
from block_manager.core.errors import InvalidRequest
from block_manager.core.hashing import BlockHash, hash_block
from block_manager.core.tiers import TierOp
from block_manager.core.types import BlockId

# Pool and BlockMeta are not imported (pool.py sits above this module; tiers.py reaches this
# module only through the host tier's `disk` / `on_evict` attributes).
Pool = Any
BlockMeta = Any

_COUNTERS = ("disk_offloaded_blocks", "disk_onboarded_blocks", "disk_hit_tokens", "disk_evictions")


@dataclass(slots=True, frozen=True)
class SeedBlock:
    """A block the node's segment file holds at registration: its slot and identity, and
    `last_used` (the node's write counter: seeds go into the LRU queue in that order)."""

    slot: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    salt: str | None
    token_ids: tuple[int, ...]
    last_used: int = 0


class DiskTier:
    """The disk slots of one pool (see the module docstring)."""

    __slots__ = ("num_blocks", "ref_cnt", "free_list", "cached_list", "meta", "prefix_index",
                 "write_step", "holds", "kv_log", *_COUNTERS)

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks          # holds only
        self.free_list = BlockList(num_blocks)
        self.cached_list = BlockList(num_blocks)
        for s in range(num_blocks):
            self.free_list.push_back(s)
        self.meta: list[BlockMeta | None] = [None] * num_blocks
        self.prefix_index: dict[BlockHash, int] = {}
        self.write_step = [0] * num_blocks
        self.holds: list[tuple[int, int]] = []   # (step id, slot) read by that step
        self.kv_log: Any = None   # a kv_events.KvChangeLog while changes are recorded
        for name in _COUNTERS:
            setattr(self, name, 0)

    @property
    def num_cached(self) -> int:
        return self.cached_list.length

    def written(self, s: int, settled_step: int) -> bool:
        return self.write_step[s] <= settled_step

    def take(self) -> int | None:
        """A slot to write: a free one, else the LRU cached one (dropped for good); None when
        every cached slot is held by a step in flight."""
        s = self.free_list.pop_front()
        if s is None:
            s = self.cached_list.pop_front()
            if s is None:
                return None
            self.drop_hash(s)
            self.disk_evictions += 1
        return s

    def lookup(self, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
               token_ids: tuple[int, ...]) -> int | None:
        s = self.prefix_index.get(block_hash)
        if s is None:
            return None
        m = self.meta[s]
        if m is None or m.token_ids != token_ids or m.parent_hash != parent or m.salt != salt:
            return None
        return s

    def drop_hash(self, s: int) -> None:
        m = self.meta[s]
        if m is not None:
            del self.prefix_index[m.block_hash]
            self.meta[s] = None
            if self.kv_log is not None:
                self.kv_log.removed(m.block_hash)

    def index(self, s: int, meta: BlockMeta) -> None:
        """Slot `s` (free, taken by the caller) holds `meta`'s block: findable by its hash."""
        self.meta[s] = meta
        self.prefix_index[meta.block_hash] = s
        if self.kv_log is not None:
            self.kv_log.stored(meta)

    def hold(self, s: int, step_id: int) -> None:
        if self.ref_cnt[s] == 0:
            self.cached_list.remove(s)
        self.ref_cnt[s] += 1
        self.holds.append((step_id, s))

    def release(self, s: int) -> None:
        self.ref_cnt[s] -= 1
        if self.ref_cnt[s]:
            return
        if self.meta[s] is not None:
            self.cached_list.push_back(s)
        else:
            self.free_list.push_front(s)

    def release_holds(self, settled_step: int) -> None:
        """Steps up to `settled_step` are reported: the slots they read are free to go."""
        if not self.holds:
            return
        keep: list[tuple[int, int]] = []
        for step_id, s in self.holds:
            if step_id <= settled_step:
                self.release(s)
            else:
                keep.append((step_id, s))
        self.holds = keep

    def fail_from(self, failed_from: int, last_closed: int) -> None:
        """Steps `failed_from … last_closed` failed: the slots they spilled into were never
        written; forget their hashes (a cached one becomes free)."""
        for s in range(self.num_blocks):
            if failed_from <= self.write_step[s] <= last_closed and self.meta[s] is not None:
                self.drop_hash(s)
                if self.ref_cnt[s] == 0 and s in self.cached_list:
                    self.cached_list.remove(s)
                    self.free_list.push_front(s)

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTERS}

    # ---- snapshot -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "free_list": list(self.free_list),
            "cached_list": list(self.cached_list),
            "hashed_blocks": [[s, m.block_hash.hex(), None if m.parent_hash is None else m.parent_hash.hex(),
                               m.salt, list(m.token_ids)] for s, m in enumerate(self.meta) if m is not None],
            "write_step": [[s, ws] for s, ws in enumerate(self.write_step) if ws],
            "holds": [list(h) for h in self.holds],
            "counters": self.counters(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_blocks: int, meta_cls: type) -> DiskTier:
        n = d["num_blocks"]
        if type(n) is not int or not 1 <= n <= max_blocks:
            raise ValueError(f"disk num_blocks {n!r}")
        disk = cls(n)
        while disk.free_list.pop_front() is not None:
            pass
        for name, lst in (("free_list", disk.free_list), ("cached_list", disk.cached_list)):
            for s in d[name]:
                if type(s) is not int or not 0 <= s < n or s in disk.free_list or s in disk.cached_list:
                    raise ValueError(f"disk {name}: bad or repeated slot {s!r}")
                lst.push_back(s)
        for s, h, parent, salt, tokens in d["hashed_blocks"]:
            meta = meta_cls(bytes.fromhex(h), None if parent is None else bytes.fromhex(parent), salt,
                            tuple(int(t) for t in tokens))
            if meta.block_hash in disk.prefix_index or not 0 <= s < n:
                raise ValueError("disk: two slots with one hash, or a bad slot")
            disk.meta[s] = meta
            disk.prefix_index[meta.block_hash] = int(s)
        for s, ws in d["write_step"]:
            disk.write_step[int(s)] = int(ws)
        for step_id, s in d["holds"]:
            disk.holds.append((int(step_id), int(s)))
            disk.ref_cnt[int(s)] += 1
        for name in _COUNTERS:
            setattr(disk, name, int(d["counters"][name]))
        return disk

    # ---- fsck ---------------------------------------------------------------------------
    def fsck(self, pool: Pool) -> list[str]:
        """Every slot in exactly one place (free, cached, or held), ref counts = holds, index
        and metadata agree, and a hash on disk names the same content as on host or device."""
        p: list[str] = []
        name = f"pool {pool.pool_id!r} disk"
        p.extend(f"{name} free list: {x}" for x in self.free_list.check())
        p.extend(f"{name} cached list: {x}" for x in self.cached_list.check())
        expected = [0] * self.num_blocks
        for _, s in self.holds:
            expected[s] += 1
        for s in range(self.num_blocks):
            in_free, in_cached, ref = s in self.free_list, s in self.cached_list, self.ref_cnt[s]
            if ref != expected[s]:
                p.append(f"{name} slot {s}: ref_cnt {ref}, held by {expected[s]}")
            if int(in_free) + int(in_cached) + int(ref > 0) != 1:
                p.append(f"{name} slot {s}: in {int(in_free) + int(in_cached) + int(ref > 0)} places")
            m = self.meta[s]
            if in_free and m is not None:
                p.append(f"{name} slot {s}: free but hashed")
            if in_cached and m is None:
                p.append(f"{name} slot {s}: cached without a hash")
            if m is None:
                continue
            if self.prefix_index.get(m.block_hash) != s:
                p.append(f"{name} slot {s}: its hash is not indexed to it")
            for tier, index, metas in (("device", pool.prefix_index, pool.meta),
                                       ("host", pool.host.prefix_index, pool.host.meta)):
                b = index.get(m.block_hash)
                om = metas[b] if b is not None else None
                if om is not None and (om.token_ids != m.token_ids or om.parent_hash != m.parent_hash
                                       or om.salt != m.salt):
                    p.append(f"{name} slot {s}: {tier} block {b} has its hash with other content")
        if len(self.prefix_index) != sum(m is not None for m in self.meta):
            p.append(f"{name}: index and metadata disagree")
        return p


# ---- operations on a pool -------------------------------------------------------------------
def attach(pool: Pool, disk: DiskTier) -> None:
    """Put `disk` under the pool's host tier: host LRU evictions spill to it from now on."""
    if pool.host is None:
        raise InvalidRequest(f"pool {pool.pool_id!r}: a disk tier needs a host tier above it")
    pool.host.disk = disk
    pool.host.on_evict = partial(spill, pool)


def check_seeds(blocks: Sequence[SeedBlock], num_slots: int, block_size: int) -> None:
    """`InvalidRequest` unless every seed names a distinct slot in range and holds one block of
    tokens (checked before a registration changes anything)."""
    seen: set[int] = set()
    for blk in blocks:
        if not 0 <= blk.slot < num_slots or blk.slot in seen:
            raise InvalidRequest(f"disk block slot {blk.slot} is outside 0..{num_slots - 1} or repeated")
        if len(blk.token_ids) != block_size:
            raise InvalidRequest(
                f"disk block slot {blk.slot}: {len(blk.token_ids)} tokens, the block size is {block_size}")
        if blk.parent_hash is not None and len(blk.parent_hash) != len(blk.block_hash):
            raise InvalidRequest(f"disk block slot {blk.slot}: malformed parent hash")
        seen.add(blk.slot)


def seed(disk: DiskTier, blocks: Sequence[SeedBlock], block_size: int, meta_cls: type) -> int:
    """Index the blocks a node's segment file holds (written before this epoch: hits at once),
    least recently used first; malformed seeds refuse the registration (`check_seeds`). Each
    hash is recomputed from its parent, tokens and salt: a block whose identity does not add up
    (another hashing version, a damaged file the checksums missed) is left out, not served.
    Returns how many were left out."""
    check_seeds(blocks, disk.num_blocks, block_size)
    skipped = 0
    for blk in sorted(blocks, key=lambda b: b.last_used):
        if hash_block(blk.parent_hash, blk.token_ids, blk.salt) != blk.block_hash:
            skipped += 1
            continue
        if blk.block_hash in disk.prefix_index:
            continue   # a duplicate copy stays a plain free slot
        disk.free_list.remove(blk.slot)
        disk.index(blk.slot, meta_cls(blk.block_hash, blk.parent_hash, blk.salt, tuple(blk.token_ids)))
        disk.cached_list.push_back(blk.slot)
    return skipped


def _queue(pool: Pool, kind: str, src: int, dst: int, meta: BlockMeta | None = None) -> None:
    pool.step.tier_ops.append(TierOp(pool.next_op_id, kind, BlockId(src), BlockId(dst), meta))  # type: ignore[arg-type]
    pool.next_op_id += 1


def spill(pool: Pool, h: int) -> None:
    """Host block `h` (cached, hashed) is being evicted: keep it on disk when it is written and
    the disk does not hold its hash yet (an LRU disk slot is overwritten when the disk is full).
    Called before `h` loses its hash."""
    host = pool.host
    disk: DiskTier = host.disk
    meta = host.meta[h]
    if meta is None or not host.written(h, pool.settled_step):
        return
    known = disk.prefix_index.get(meta.block_hash)
    if known is not None:
        if disk.ref_cnt[known] == 0 and disk.written(known, pool.settled_step):
            disk.cached_list.remove(known)   # touched: most recently used again
            disk.cached_list.push_back(known)
        return
    s = disk.take()
    if s is None:
        return
    disk.index(s, meta)
    disk.cached_list.push_back(s)
    disk.write_step[s] = pool.step.step_id
    disk.disk_offloaded_blocks += 1
    _queue(pool, "disk_offload", h, s, meta)


def disk_hits(pool: Pool, tokens: Any, hashes: list[BlockHash], salt: str | None, start: int,
              parent: BlockHash | None, host_room: int) -> list[int]:
    """Written disk slots continuing a (device + host) prefix hit of `start` blocks, capped
    like the other hits (one prompt token left to compute) and by `host_room`: each one is
    staged through a fresh host block. Stops at a hash the host tier holds (it is not written
    yet there, or it is other content: either way not this prompt's prefix to serve)."""
    host = pool.host
    disk: DiskTier | None = None if host is None else host.disk
    if disk is None or host_room <= 0:
        return []
    bs = pool.block_size
    max_hits = min(len(hashes), (len(tokens) - 1) // bs, start + host_room)
    out: list[int] = []
    for i in range(start, max_hits):
        if hashes[i] in host.prefix_index:
            break
        s = disk.lookup(hashes[i], parent, salt, tuple(tokens[i * bs: (i + 1) * bs]))
        if s is None or not disk.written(s, pool.settled_step):
            break
        out.append(s)
        parent = hashes[i]
    return out


def pin(pool: Pool, slots: Iterable[int]) -> None:
    """Hold disk hits (until the open step is reported) before any host or device block is
    taken: a spill could otherwise overwrite them."""
    disk: DiskTier = pool.host.disk
    step_id = pool.step.step_id
    for s in slots:
        disk.hold(s, step_id)


def stage(pool: Pool, slots: list[int]) -> list[int]:
    """Queue disk→host moves of pinned disk hits into fresh host blocks (the caller counted
    the room); returns the host blocks, each referenced once (the caller turns that reference
    into a hold of the step by onboarding them host→device). A staged block joins the host
    index (written once the step is reported) so the next prompt hits it on host."""
    host = pool.host
    disk: DiskTier = host.disk
    step_id = pool.step.step_id
    out: list[int] = []
    for s in slots:
        h = host.take()
        if h is None:   # disk_hits capped the hits by the room: unreachable unless misused
            raise InvalidRequest("internal: host tier exhausted while staging disk hits")
        meta = disk.meta[s]
        if meta is not None and meta.block_hash not in host.prefix_index:
            host.meta[h] = meta
            host.prefix_index[meta.block_hash] = h
            if host.kv_log is not None:
                host.kv_log.stored(meta)
        host.write_step[h] = step_id
        _queue(pool, "disk_onboard", s, h)
        out.append(h)
    disk.disk_onboarded_blocks += len(slots)
    disk.disk_hit_tokens += len(slots) * pool.block_size
    return out


__all__ = ["DiskTier", "SeedBlock", "attach", "check_seeds", "disk_hits", "pin", "seed", "spill", "stage"]
