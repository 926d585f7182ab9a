"""A step's moves never fight over a block, in the order the node runs them: device->host
moves, then host->device moves (one batched scatter each), then the copy ops, then the token
writes. A block an op of the open step still names can be freed in that step (its other
holder freed, a failure report dropping its sequence, a swapped-in sequence freed again); a
host->device move (swap-in, onboard) of the same step must then not take it — the copy would
read or overwrite what the move wrote, or two moves would land in one block — and the room
checks (`can_swap_in`, the allocation's) count such blocks out until the step closes. On the
host side, a swapped-out sequence freed in its swap-out step keeps its host blocks held until
that step is reported, so another device->host move of the step cannot write them twice.
Each test fails on the core before this rule (block_manager/core/step_order.py).
"""

from __future__ import annotations

import pytest

from block_manager.core import BlockManager, OutOfBlocks, StepOutput
from tests.block_manager.core.one_pool import BS, one_pool, run_step


def _to_device(out: StepOutput) -> list[int]:
    return [op.dst for op in out.tier_ops if op.kind in ("swap_in", "onboard")]


def _conflicts(out: StepOutput) -> set[int]:
    """Device blocks a host->device move of `out` writes that a copy of it also names, or that
    two such moves write."""
    copied = {b for op in out.copy_ops for b in (op.src, op.dst)}
    dsts = _to_device(out)
    return (set(dsts) & copied) | {d for d in dsts if dsts.count(d) > 1}


def _close(m: BlockManager) -> None:
    """Close the open step even with table changes only, and report it done."""
    out = m.close_step("p", force=True)
    assert out is not None
    m.settle_steps("p", out.step_id)


def test_a_swap_in_never_writes_a_copy_destination_freed_by_a_failure_report() -> None:
    """A failure report drops "a", which copied on write in the open step: its copy destination
    is free at once, but the copy still runs in the open step, after its host->device moves."""
    m = one_pool(8, host=8)
    m.allocate("x", "p", num_tokens=2 * BS)          # blocks 0-1
    m.allocate("a", "p", num_tokens=BS + 1)          # blocks 2-3, partial last
    run_step(m)
    m.fork("a", ["b"])
    m.swap_out(["x"])
    run_step(m)
    m.allocate("c", "p", num_tokens=BS)
    failing = m.close_step("p")                      # handed out, not reported yet
    assert failing is not None
    (cow,) = m.append_tokens(["a"], [1]).copy_ops.values()
    res = m.settle_steps("p", failing.step_id - 1, failed_from=failing.step_id)
    assert set(res.dropped_seq_ids) == {"a", "c"}    # "a" was touched after the failed step
    m.swap_in(["x"])
    out = m.close_step("p")
    assert out is not None and cow in out.copy_ops
    assert cow.dst not in _to_device(out) and _conflicts(out) == set()
    assert m.fsck() == []


def test_two_swap_ins_of_one_step_never_write_one_block() -> None:
    """"x" swapped in and freed again in one step: its blocks are free, but their host->device
    moves are still in the step; "y", swapped in after, must not land in the same blocks."""
    m = one_pool(8, host=8)
    m.allocate("x", "p", num_tokens=2 * BS)
    m.allocate("y", "p", num_tokens=2 * BS)
    run_step(m)
    m.swap_out(["x", "y"])
    run_step(m)
    (vx,) = m.swap_in(["x"])
    m.free(["x"])
    (vy,) = m.swap_in(["y"])
    assert not set(vx.block_table) & set(vy.block_table)
    out = m.close_step("p")
    assert out is not None and len(_to_device(out)) == 4 and _conflicts(out) == set()
    assert m.fsck() == []


def test_an_onboard_never_writes_a_block_the_open_step_still_copies_from() -> None:
    """The allocation path's host->device moves follow the same rule as a swap-in's: a prompt
    whose prefix is on host is onboarded outside the freed copy-on-write source."""
    m = one_pool(8, host=8)
    prompt = list(range(1, 2 * BS + 2))              # 2 full hashed blocks + 1
    m.allocate("h", "p", prompt)
    run_step(m)
    m.free(["h"])
    m.evict("p", 2)                                  # the 2 full blocks go to host
    run_step(m)
    m.allocate("a", "p", num_tokens=BS + 1)
    run_step(m)
    m.fork("a", ["b"])
    _close(m)
    (cow,) = m.append_tokens(["a"], [1]).copy_ops.values()
    m.free(["b"])                                    # the copy's source has no holder left
    r = m.allocate("z", "p", prompt)
    assert r.num_cached_tokens == 2 * BS              # the host hits
    out = m.close_step("p")
    assert out is not None and len(_to_device(out)) == 2
    assert cow.src not in _to_device(out) and _conflicts(out) == set()
    assert cow.src in r.block_table                  # the Forward's own writes may use it
    assert m.fsck() == []


def _only_a_copy_source_free() -> tuple[BlockManager, int]:
    """Pool p, 5 blocks: "x" swapped out; "a" copies on write into the block "x" left, its fork
    "b" — the last other holder of the source — freed: the source is the one free block."""
    m = one_pool(5, host=8)
    m.allocate("x", "p", num_tokens=BS)              # block 0
    m.allocate("a", "p", num_tokens=BS + 1)          # blocks 1-2, partial last
    m.allocate("y", "p", num_tokens=2 * BS)          # blocks 3-4
    run_step(m)
    m.fork("a", ["b"])
    m.swap_out(["x"])
    run_step(m)
    (cow,) = m.append_tokens(["a"], [1]).copy_ops.values()
    m.free(["b"])
    assert m.free_blocks("p") == (1, 1)
    return m, cow.src


def test_a_swap_in_room_leaves_out_what_the_open_step_copies_from_until_it_closes() -> None:
    m, src = _only_a_copy_source_free()
    assert not m.can_swap_in(["x"])
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks, match="swap-in needs 1 blocks, 0 available"):
        m.swap_in(["x"])
    assert m.to_snapshot() == before and m.is_swapped("x")
    run_step(m)                                      # the copy is handed out: the block may go
    assert m.can_swap_in(["x"])
    (view,) = m.swap_in(["x"])
    assert list(view.block_table) == [src] and m.fsck() == []


def test_the_forward_s_own_writes_may_still_take_a_block_the_open_step_copies_from() -> None:
    m, src = _only_a_copy_source_free()
    assert m.can_allocate("p", BS)
    r = m.allocate("n", "p", num_tokens=BS)
    assert r.block_table == (src,) and m.fsck() == []


def test_a_swapped_out_sequence_freed_in_its_swap_out_step_keeps_its_host_blocks_until_reported() -> None:
    """Two device->host moves of one step into one host block would land in one batched copy
    with no defined winner: the host block of a swap-out is held by its step, like an offload's."""
    m = one_pool(8, host=2)
    m.allocate("x", "p", num_tokens=BS)
    m.allocate("y", "p", num_tokens=BS)
    run_step(m)
    m.swap_out(["x"])
    m.free(["x"])                                    # its host block goes back... after the step
    m.swap_out(["y"])
    out = m.close_step("p")
    assert out is not None
    to_host = [op.dst for op in out.tier_ops if op.to_host]
    assert len(to_host) == 2 and len(set(to_host)) == 2
    assert m.host_metrics("p").num_used_blocks == 2 and m.fsck() == []
    m.settle_steps("p", out.step_id)
    assert m.host_metrics("p").num_used_blocks == 1 and m.fsck() == []


def test_a_swap_in_never_reclaims_a_defrag_plan_for_a_block_the_open_step_copies_from() -> None:
    """The unsent plan's destination is the freed copy-on-write source: aborting the plan would
    free only that block, which the swap-in may not take — so it neither aborts the plan nor
    takes the block; once the step is handed out, it may."""
    m = one_pool(6, host=8)
    m.allocate("a", "p", num_tokens=BS + 1)          # blocks 0-1, partial last
    m.allocate("x", "p", num_tokens=BS)              # block 2
    m.allocate("y", "p", num_tokens=BS)              # block 3
    m.allocate("w", "p", num_tokens=2 * BS)          # blocks 4-5
    run_step(m)
    m.fork("a", ["b"])
    m.swap_out(["x"])
    run_step(m)
    (cow,) = m.append_tokens(["a"], [1]).copy_ops.values()
    m.free(["b"])
    plan = m.plan_defrag("p", "compaction")
    assert plan is not None and [op.dst for op in plan.moves] == [cow.src]
    assert m.free_blocks("p") == (0, 1)
    assert not m.can_swap_in(["x"])
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks, match="swap-in needs 1 blocks"):
        m.swap_in(["x"])
    assert m.to_snapshot() == before and m.get_defrag_plan("p") is not None
    out = m.close_step("p")
    assert out is not None and _conflicts(out) == set()
    m.settle_steps("p", out.step_id)                 # the plan commits: block 5 is free now
    assert m.can_swap_in(["x"])
    m.swap_in(["x"])
    assert m.fsck() == []


def test_an_allocation_with_host_hits_counts_out_the_blocks_the_open_step_copies_from() -> None:
    """3 blocks free, 2 of them freed copy-on-write sources: a prompt of 3 blocks whose first 2
    come from host does not fit (the 2 onboards need blocks outside the copies) until the step
    is handed out; the allocation changes nothing meanwhile."""
    m = one_pool(9, host=8)
    prompt = list(range(1, 2 * BS + 2))              # 2 full hashed blocks + 1
    m.allocate("h", "p", prompt)
    run_step(m)
    m.free(["h"])
    m.evict("p", 2)
    run_step(m)
    m.allocate("a1", "p", num_tokens=BS + 1)
    m.allocate("a2", "p", num_tokens=BS + 1)
    run_step(m)
    m.fork("a1", ["b1"])
    m.fork("a2", ["b2"])
    _close(m)
    m.append_tokens(["a1", "a2"], [1, 1])            # two copies on write
    m.allocate("f", "p", num_tokens=2 * BS)          # 1 block left
    m.free(["b1", "b2"])                             # 3 free: the 2 copy sources and 1 other
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks, match="2 of them moved in from host"):
        m.allocate("z", "p", prompt)
    assert m.to_snapshot() == before
    run_step(m)
    r = m.allocate("z", "p", prompt)
    assert r.num_cached_tokens == 2 * BS and m.fsck() == []
