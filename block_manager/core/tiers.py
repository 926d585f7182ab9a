"""The host tier of a pool: a second set of blocks, in the compute node's host memory, under
its device pool — the ledger of swap preemption, offload of evicted prefix blocks and
onboarding on a host hit.

Host block ids are their own id space (`0 … host_num_blocks-1`, the index into the node's
host tensors); a block lives in a node's device pool, its host pool, or nowhere, and the
pool's two ledgers say which. The host ledger has what the device one has — ref counts, a
free queue, an LRU queue of cached (hashed, unreferenced) blocks and a prefix index — and a
host block's holders are swapped-out sequences (one reference each) and the steps that read
it (a *hold*, released when that step is reported: the source of a move stays pinned until
the report).

Tier moves are ops of the open step (`StepWork.tier_ops`), like copy-on-write copies and
defrag moves: the node runs a step's device→host moves first, then its host→device moves,
then its copy ops, then its writes, so
- a device block released by a swap-out (or evicted and offloaded) may be reused by another
  sequence in the very step: its content is read before anything in the step writes it;
- a host block read by a swap-in or an onboard is held until the step is reported, so no
  device→host move of the same step (or a later one still in flight) can overwrite it;
- a host block is *written* once the step carrying its device→host move is reported
  complete (`write_step <= settled_step`): only then may it be swapped in or onboarded. An
  offloaded block is held by its writing step until then, so it is never evicted (nor
  spilled to disk) before its bytes are there, nor written twice by one step. A
  step reported failed drops the swapped-out sequences it carried (their K/V never reached
  host: the scheduler recomputes them) and forgets the hashes of the blocks it offloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from block_manager.core.block_tier import BlockMeta, LowerTier, check_num_blocks
from block_manager.core.disk_tier import DiskTier
from block_manager.core.hashing import BlockHash
from block_manager.core.types import BlockId, SeqId

TierKind = Literal["swap_out", "swap_in", "offload", "onboard", "disk_offload", "disk_onboard"]
TIER_KINDS: tuple[TierKind, ...] = ("swap_out", "swap_in", "offload", "onboard", "disk_offload", "disk_onboard")
TO_HOST: frozenset[str] = frozenset(("swap_out", "offload"))
DISK_KINDS: frozenset[str] = frozenset(("disk_offload", "disk_onboard"))   # disk_tier.py


@dataclass(slots=True, frozen=True)
class TierOp:
    """Copy one block between tiers on the pool's node (all layers, K and V).

    `swap_out` / `offload`: `src` is a device block, `dst` a host block; `swap_in` /
    `onboard`: `src` is a host block, `dst` a device block. The disk tier's (disk_tier.py):
    `disk_offload` host block -> disk slot, with `meta` (the block's identity, which the node
    keeps with the bytes); `disk_onboard` disk slot -> host block. `op_id` shares the pool's
    copy-op counter, so ops of a pool are totally ordered."""

    op_id: int
    kind: TierKind
    src: BlockId
    dst: BlockId
    meta: BlockMeta | None = None

    @property
    def to_host(self) -> bool:
        return self.kind in TO_HOST


@dataclass(slots=True)
class SwappedSeq:
    """A sequence whose table lives on host: what resuming it on device needs.

    `data_step` is the last step that wrote or changed it on device before the swap-out,
    `swap_step` the step carrying its device→host moves; a failure of either drops it."""

    seq_id: SeqId
    host_table: list[int]
    num_tokens: int
    salt: str | None
    hashing: bool
    tail_token_ids: list[int]
    block_hashes: list[BlockHash]
    data_step: int
    swap_step: int


class HostTier(LowerTier):
    """The host blocks of one pool (see the module docstring). Besides the steps' holds, a
    host block is referenced by each swapped-out sequence whose table holds it."""

    COUNTERS: ClassVar[tuple[str, ...]] = (
        "swapped_out_blocks", "swapped_in_blocks", "offloaded_blocks", "onboarded_blocks",
        "host_hit_tokens", "host_evictions", "swap_outs", "swap_ins")
    KIND: ClassVar[str] = "host"

    __slots__ = ("swapped", "disk", "on_evict", *COUNTERS)

    swapped_out_blocks: int
    swapped_in_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int
    host_hit_tokens: int
    host_evictions: int
    swap_outs: int
    swap_ins: int

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.swapped: dict[SeqId, SwappedSeq] = {}
        self.disk: DiskTier | None = None   # the disk tier under this one (Pool.attach_disk), if any
        # called with a cached block evicted for good, before it loses its hash (Pool's disk spill)
        self.on_evict: Callable[[int], None] | None = None

    def take(self) -> int | None:
        """A host block for a new owner (ref_cnt 1): a free one, else the LRU cached one,
        evicted (spilled to the disk tier when there is one). None when every block is held."""
        b = self.free_list.pop_front()
        if b is None:
            b = self.cached_list.pop_front()
            if b is None:
                return None
            if self.on_evict is not None:
                self.on_evict(b)
            self.drop_hash(b)
            self.host_evictions += 1
        self.ref_cnt[b] = 1
        return b

    def offload(self, meta: BlockMeta, step_id: int) -> int | None:
        """Keep an evicted device block's content (`meta`) in a host block written by step
        `step_id`; the block, or None when every host block is held."""
        h = self.take()
        if h is None:
            return None
        # Held by its writing step until that step is reported (then it joins the cached LRU):
        # a block still being written can be neither evicted again nor retaken in the same step,
        # which would give one batched device->host copy two writes into one host block.
        self.holds.append((step_id, h))
        self.index(h, meta)
        self.write_step[h] = step_id
        self.offloaded_blocks += 1
        return h

    def release_holds(self, settled_step: int) -> None:
        """Steps up to `settled_step` are reported: the host blocks (and disk slots) they read
        are free to go."""
        if self.disk is not None:
            self.disk.release_holds(settled_step)
        super().release_holds(settled_step)

    def drop_swapped(self, seq_id: SeqId) -> None:
        """Forget a swapped-out sequence (freed, or its K/V never reached host)."""
        rec = self.swapped.pop(seq_id)
        for h in reversed(rec.host_table):
            self.release(h)

    def fail_from(self, failed_from: int, last_closed: int) -> list[SeqId]:
        """Steps `failed_from … last_closed` failed: the swap-outs and offloads they carried
        never wrote host memory, nor did steps before them write what those swap-outs copied.
        Drops those swapped sequences (returned) and forgets the hashes of those blocks (and of
        the disk slots those steps spilled into)."""
        dropped = [sid for sid, rec in self.swapped.items()
                   if rec.data_step >= failed_from or failed_from <= rec.swap_step <= last_closed]
        for sid in dropped:
            self.drop_swapped(sid)
        if self.disk is not None:
            self.disk.forget_written(failed_from, last_closed)
        self.forget_written(failed_from, last_closed)
        return dropped

    # ---- snapshot -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "ref_cnt": list(self.ref_cnt),
            **self.ledger_to_dict(),
            "swapped": [[r.seq_id, r.host_table, r.num_tokens, r.salt, r.hashing, r.tail_token_ids,
                         [h.hex() for h in r.block_hashes], r.data_step, r.swap_step]
                        for r in self.swapped.values()],
            "counters": self.counters(),
            **({"disk": self.disk.to_dict()} if self.disk is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_blocks: int) -> HostTier:
        """`to_dict` output back, without its disk tier (the pool attaches that)."""
        n = check_num_blocks(d, max_blocks, cls.KIND)
        host = cls(n)
        ref = [int(x) for x in d["ref_cnt"]]
        if len(ref) != n:
            raise ValueError("host ref_cnt length differs from num_blocks")
        host.ref_cnt = ref
        host.ledger_from_dict(d)
        for sid, table, num_tokens, salt, hashing, tail, hashes, data_step, swap_step in d["swapped"]:
            host.swapped[SeqId(sid)] = SwappedSeq(SeqId(sid), [int(b) for b in table], int(num_tokens), salt,
                                                  bool(hashing), [int(t) for t in tail],
                                                  [bytes.fromhex(h) for h in hashes], int(data_step),
                                                  int(swap_step))
        return host


__all__ = ["HostTier", "SwappedSeq", "TierOp", "TierKind", "DISK_KINDS", "TIER_KINDS", "TO_HOST"]
