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
  block spills it to disk instead of dropping it (`DiskTier.spill`, through the host tier's
  `on_evict` hook: `Pool.spill`);
  when the disk is full the LRU cached slot is overwritten (dropped for good).
- `disk_onboard` (disk slot → host block): a prompt's prefix continuing past the device and
  host hits onto disk slots is staged into fresh host blocks, then onboarded host → device in
  the same step (allocation.py).
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from block_manager.core.block_tier import BlockMeta, LowerTier, check_num_blocks
from block_manager.core.errors import InvalidRequest
from block_manager.core.hashing import BlockHash, hash_block


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


class DiskTier(LowerTier):
    """The disk slots of one pool (see the module docstring); a slot's references are the
    holds of the steps that read it."""

    COUNTERS: ClassVar[tuple[str, ...]] = ("disk_offloaded_blocks", "disk_onboarded_blocks", "disk_hit_tokens",
                                           "disk_evictions")
    KIND: ClassVar[str] = "disk"

    __slots__ = COUNTERS

    disk_offloaded_blocks: int
    disk_onboarded_blocks: int
    disk_hit_tokens: int
    disk_evictions: int

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

    def spill(self, meta: BlockMeta, settled_step: int, step_id: int) -> int | None:
        """A written host block holding `meta` is evicted: the slot that step `step_id` writes
        it into, or None — the disk holds its hash already (touched: most recently used again)
        or every slot is held. When the disk is full the LRU cached slot is overwritten."""
        known = self.prefix_index.get(meta.block_hash)
        if known is not None:
            if self.ref_cnt[known] == 0 and self.written(known, settled_step):
                self.cached_list.remove(known)
                self.cached_list.push_back(known)
            return None
        s = self.take()
        if s is None:
            return None
        self.index(s, meta)
        self.cached_list.push_back(s)
        self.write_step[s] = step_id
        self.disk_offloaded_blocks += 1
        return s

    # ---- snapshot -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"num_blocks": self.num_blocks, **self.ledger_to_dict(), "counters": self.counters()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_blocks: int) -> DiskTier:
        disk = cls(check_num_blocks(d, max_blocks, cls.KIND))
        disk.ledger_from_dict(d)
        for _, s in disk.holds:
            disk.ref_cnt[s] += 1
        return disk


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


def seed(disk: DiskTier, blocks: Sequence[SeedBlock], block_size: int) -> int:
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
        disk.index(blk.slot, BlockMeta(blk.block_hash, blk.parent_hash, blk.salt, tuple(blk.token_ids)))
        disk.cached_list.push_back(blk.slot)
    return skipped


__all__ = ["DiskTier", "SeedBlock", "check_seeds", "seed"]
