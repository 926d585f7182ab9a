"""Swap preemption: sequences moved to their pool's host tier and back (the host tier's
ledger: tiers.py).

A swap-out copies a group of sequences' device blocks to host in the open step (a block
shared inside the group once) and releases the device side: the copy reads each block before
anything of the step writes it, so the released blocks may serve another sequence in the
very step. A swap-in takes fresh device blocks and queues host→device copies, which the node
runs before the step's copies: so not a block those copies still name (step_order.py). The
host blocks stay held until that step is reported. Both are all or nothing, validated per
pool before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from block_manager.core import defrag as _defrag
from block_manager.core.errors import (
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    PendingWrite,
    PoolDraining,
    UnknownSequence,
)
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence, late_pending
from block_manager.core.step_order import BlockTaker, busy_blocks, early_room
from block_manager.core.step_work import note_created
from block_manager.core.steps import drop_sequence
from block_manager.core.tiers import HostTier, SwappedSeq
from block_manager.core.types import PoolId, SeqId, SequenceView

T = TypeVar("T")


def swapped_pool(pools: dict[PoolId, Pool], seq_id: SeqId) -> Pool | None:
    """The pool whose host tier holds `seq_id` swapped out, if any."""
    for pool in pools.values():
        if pool.host is not None and seq_id in pool.host.swapped:
            return pool
    return None


def find_sequence(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_id: SeqId) -> Sequence:
    """The live sequence; `FailedPrecondition` when it is swapped out, else `UnknownSequence`."""
    seq = seqs.get(seq_id)
    if seq is None:
        if swapped_pool(pools, seq_id) is not None:
            raise FailedPrecondition(f"sequence {seq_id!r} is swapped out to host; swap it in first")
        raise UnknownSequence(f"unknown sequence {seq_id!r}")
    return seq


def host_of(pool: Pool) -> HostTier:
    if pool.host is None:
        raise FailedPrecondition(f"pool {pool.pool_id!r} has no host tier (registered with 0 host blocks)")
    return pool.host


def _by_pool(pools: dict[PoolId, Pool], items: Iterable[T],
             pool_of: Callable[[T], PoolId]) -> list[tuple[Pool, list[T]]]:
    groups: dict[PoolId, list[T]] = {}
    for it in items:
        groups.setdefault(pool_of(it), []).append(it)
    return [(pools[pid], group) for pid, group in groups.items()]


def _check_ids(ids: list[SeqId], what: str) -> None:
    if not ids:
        raise InvalidRequest(f"{what} needs at least one sequence id")
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"duplicate sequence ids in {what}")


# ---- swap-out ----------------------------------------------------------------------------------
def _check_out_group(pool: Pool, seqs: list[Sequence]) -> int:
    """Validate a swap-out of `seqs` (all of one pool); the number of host blocks it needs."""
    host = host_of(pool)
    open_id = pool.step.step_id
    distinct: set[int] = set()
    for seq in seqs:
        if (pending := late_pending(seq)) is not None:
            raise pending
        if seq.last_write_step == open_id or any(pool.write_step[b] == open_id for b in seq.block_table):
            raise PendingWrite(
                f"sequence {seq.seq_id!r} has blocks written in open step {open_id} of pool {pool.pool_id!r}; "
                "swap it out after that step's Forward"
            )
        distinct.update(seq.block_table)
    if len(distinct) > host.num_available:
        raise OutOfBlocks(
            f"pool {pool.pool_id!r}: host tier full ({len(distinct)} blocks needed, {host.num_available} available)"
        )
    return len(distinct)


def check_swap_out(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence],
                   ids: list[SeqId]) -> list[tuple[Pool, list[Sequence]]]:
    """Validate a swap-out (nothing changes); the sequences grouped by pool."""
    _check_ids(ids, "swap_out")
    groups = _by_pool(pools, [find_sequence(pools, seqs, sid) for sid in ids], lambda s: s.pool_id)
    for pool, group in groups:
        _check_out_group(pool, group)
    return groups


def _copy_out(pool: Pool, seqs: list[Sequence]) -> None:
    """Copy the device blocks of `seqs` to host (a block shared inside the group goes once)
    and record each sequence as swapped out; each host block is also held by the open step
    until it is reported. The caller releases the device side."""
    host = host_of(pool)
    step_id = pool.step.step_id
    mapping: dict[int, int] = {}
    for seq in seqs:
        table: list[int] = []
        for b in seq.block_table:
            h = mapping.get(b)
            if h is None:
                h = host.take()
                if h is None:   # _check_out_group counted the room: unreachable unless misused
                    raise InvalidRequest("internal: host tier exhausted during swap-out")
                mapping[b] = h
                host.write_step[h] = step_id
                # held by the step writing it, like an offload's block: freed with its sequence
                # in this very step, it could otherwise take a second write in the same batched
                # device->host copy (no defined winner)
                host.ref_cnt[h] += 1
                host.holds.append((step_id, h))
                pool.queue_tier_op("swap_out", b, h)
            else:
                host.ref_cnt[h] += 1
            table.append(h)
        host.swapped[seq.seq_id] = SwappedSeq(seq.seq_id, table, seq.num_tokens, seq.salt, seq.hashing,
                                              seq.tail_token_ids, list(seq.block_hashes), seq.last_touched_step,
                                              step_id)
    host.swapped_out_blocks += len(mapping)
    host.swap_outs += len(seqs)


def swap_out(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], ids: list[SeqId]) -> None:
    """`BlockManager.swap_out`."""
    for pool, group in check_swap_out(pools, seqs, ids):
        _copy_out(pool, group)
        for seq in group:
            drop_sequence(seqs, pool, seq.seq_id)


# ---- swap-in -----------------------------------------------------------------------------------
@dataclass(slots=True)
class SwapInGroup:
    """A validated swap-in of one pool: its swapped records, and whether its unsent defrag plan
    must be aborted to make room (decided by the check, done by the swap-in itself)."""

    pool: Pool
    recs: list[SwappedSeq]
    reclaim: bool


def _check_in_group(pool: Pool, recs: list[SwappedSeq], reserve: int) -> bool:
    """Validate a swap-in of `recs` (all of one pool) needing fresh blocks above `reserve`;
    whether it needs the blocks of the pool's unsent defrag plan. Those count as room here
    exactly as they do for an allocation (allocation.check_room): `can_swap_in` must agree
    with `swap_in`, which aborts that plan when, and only when, its blocks make room enough."""
    host = host_of(pool)
    distinct: set[int] = set()
    for rec in recs:
        for h in rec.host_table:
            if not host.written(h, pool.settled_step):
                raise PendingWrite(
                    f"sequence {rec.seq_id!r}: its swap-out (step {host.write_step[h]}) is not reported "
                    f"complete yet (pool {pool.pool_id!r} settled up to {pool.settled_step})"
                )
            distinct.add(h)
    # The fresh blocks receive host->device moves, which the node runs before the step's
    # copies: blocks those copies still name do not count (step_order.py).
    busy = busy_blocks(pool.step)
    available = min(pool.num_available - reserve, early_room(pool, busy))
    if len(distinct) <= available:
        return False
    reclaimable = _defrag.unsent_plan_blocks(pool)
    with_plan = min(pool.num_available + reclaimable - reserve, early_room(pool, busy, reclaim=True))
    if len(distinct) > with_plan:
        raise OutOfBlocks(
            f"pool {pool.pool_id!r}: swap-in needs {len(distinct)} blocks, {max(available, 0)} available "
            f"above the watermark and outside the open step's copies ({reclaimable} more held by an unsent "
            "defrag plan)"
        )
    return True


def check_swap_in(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], ids: list[SeqId],
                  watermark: float) -> list[SwapInGroup]:
    """Validate a swap-in (nothing changes); the swapped records grouped by pool. Every pool
    is checked before `swap_in` changes any, so a refusal in one pool leaves the others'
    defrag plans in place."""
    _check_ids(ids, "swap_in")
    recs: list[tuple[PoolId, SwappedSeq]] = []
    for sid in ids:
        pool = swapped_pool(pools, sid)
        if pool is None:
            if sid in seqs:
                raise FailedPrecondition(f"sequence {sid!r} is not swapped out")
            raise UnknownSequence(f"unknown sequence {sid!r}")
        recs.append((pool.pool_id, host_of(pool).swapped[sid]))
    groups: list[SwapInGroup] = []
    for pool, group in _by_pool(pools, recs, lambda x: x[0]):
        if pool.draining:
            raise PoolDraining(f"pool {pool.pool_id!r} is draining")
        swapped = [r for _, r in group]
        groups.append(SwapInGroup(pool, swapped, _check_in_group(pool, swapped, int(watermark * pool.num_blocks))))
    return groups


def _copy_in(pool: Pool, recs: list[SwappedSeq]) -> dict[SeqId, list[int]]:
    """Copy the host blocks of `recs` into fresh device blocks (shared ones once); their host
    references become holds of the open step. Returns each sequence's new device table."""
    host = host_of(pool)
    step_id = pool.step.step_id
    mapping: dict[int, int] = {}
    tables: dict[SeqId, list[int]] = {}
    taker = BlockTaker(pool, busy_blocks(pool.step))   # the check counted the room it leaves
    for rec in recs:
        table: list[int] = []
        for h in rec.host_table:
            d = mapping.get(h)
            if d is None:
                d = taker.take()
                mapping[h] = d
                pool.write_step[d] = step_id
                pool.queue_tier_op("swap_in", h, d)
            else:
                pool.share_block(d)
            table.append(d)
            host.holds.append((step_id, h))
        del host.swapped[rec.seq_id]
        tables[rec.seq_id] = table
    taker.done()
    host.swapped_in_blocks += len(mapping)
    host.swap_ins += len(recs)
    return tables


def swap_in(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], ids: list[SeqId],
            watermark: float) -> list[SequenceView]:
    """`BlockManager.swap_in`: the resumed sequences' views, their tables announced anew in
    the open step."""
    views: list[SequenceView] = []
    for group in check_swap_in(pools, seqs, ids, watermark):
        pool, recs = group.pool, group.recs
        if group.reclaim:
            # The check counted this plan's blocks as the room the swap-in lacks (a pool's
            # open step may wait long for token work: see defrag.reclaim_unsent_plan).
            _defrag.reclaim_unsent_plan(pool)
        tables = _copy_in(pool, recs)
        step = pool.step
        for rec in recs:
            seq = Sequence(rec.seq_id, pool.pool_id, tables[rec.seq_id], rec.num_tokens, pool.new_version(),
                           rec.salt, rec.hashing, rec.tail_token_ids, rec.block_hashes,
                           last_step=step.step_id, cols=pool.cols)
            seqs[rec.seq_id] = seq
            pool.seqs[rec.seq_id] = seq
            note_created(step, seq, rec.num_tokens)
            views.append(seq.view())
    return views


__all__ = ["SwapInGroup", "check_swap_in", "check_swap_out", "find_sequence", "host_of", "swap_in", "swap_out",
           "swapped_pool"]
