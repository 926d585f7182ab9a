"""A swap-in's room counts the blocks of a defrag plan no node has yet, as an allocation's does
(defrag.reclaim_unsent_plan): `can_swap_in` says yes exactly when `swap_in` succeeds, and the
plan is aborted only by a swap-in that then goes through. A refused swap-in — short of blocks
even with the plan's, or refused in another pool of the same call — leaves everything as it was,
the plan included. (Found by the two-tier state machine: the swap-in aborted the plan first and
checked the room after, and `can_swap_in` did not count the plan's blocks at all.)"""

from __future__ import annotations

import pytest

from block_manager.core import BlockManager, OutOfBlocks
from tests.block_manager.core.one_pool import BS, one_pool, run_step


def _swapped_with_unsent_plan() -> BlockManager:
    """Pool p, 8 blocks: "a" (3 blocks) swapped out and reported; "x" and "y" (2 blocks each)
    around the hole it left, so a compaction plan in the open step reserves 2 of the 4 free
    blocks: 2 available, 4 with the plan's."""
    m = one_pool(8, host=8)
    m.allocate("x", "p", num_tokens=2 * BS)          # blocks 0-1
    m.allocate("a", "p", num_tokens=3 * BS)          # blocks 2-4
    m.allocate("y", "p", num_tokens=2 * BS)          # blocks 5-6
    run_step(m)
    m.swap_out(["a"])
    run_step(m)
    plan = m.plan_defrag("p", "compaction")
    assert plan is not None and len(plan.moves) == 2 and plan.step_id == m.open_step_id("p")
    assert m.free_blocks("p") == (2, 4)
    return m


def test_can_swap_in_counts_an_unsent_plan_like_swap_in() -> None:
    m = _swapped_with_unsent_plan()
    assert m.can_swap_in(["a"])                      # 3 blocks: 2 free + the plan's
    (view,) = m.swap_in(["a"])
    assert view.num_tokens == 3 * BS and len(view.block_table) == 3
    assert m.get_defrag_plan("p") is None            # aborted for the room it held
    out = m.close_step("p")
    assert out is not None and out.copy_ops == () and out.plan_id is None
    assert sorted(op.dst for op in out.tier_ops) == sorted(view.block_table)
    assert m.fsck() == []


def test_a_swap_in_short_even_with_the_plan_changes_nothing() -> None:
    m = _swapped_with_unsent_plan()
    m.allocate("z", "p", num_tokens=2 * BS)          # the 2 free blocks: 0 available, 2 with the plan
    assert not m.can_swap_in(["a"])
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks, match="swap-in needs 3 blocks"):
        m.swap_in(["a"])
    assert m.to_snapshot() == before                 # the plan is still there
    assert m.get_defrag_plan("p") is not None and m.is_swapped("a")
    assert m.fsck() == []


def test_a_swap_in_refused_in_one_pool_keeps_the_other_pools_plan() -> None:
    m = _swapped_with_unsent_plan()
    m.add_pool("q", 2, BS, host_num_blocks=4)
    m.allocate("b", "q", num_tokens=2 * BS)
    m.settle_steps("q", m.close_step("q").step_id)
    m.swap_out(["b"])
    m.settle_steps("q", m.close_step("q", force=True).step_id)
    m.allocate("c", "q", num_tokens=BS)              # q keeps 1 of the 2 blocks "b" needs
    assert not m.can_swap_in(["a", "b"])
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks, match="'q'"):
        m.swap_in(["a", "b"])
    assert m.to_snapshot() == before                 # p's plan was not aborted for "a"
    assert m.get_defrag_plan("p") is not None and m.fsck() == []


def test_a_swap_in_never_writes_a_block_the_open_step_still_copies_from() -> None:
    """Found with the bug above ("reads back wrong tokens on the node"): "a" copies its shared
    partial block on write, its fork "b" — the last holder of the source — is freed in the same
    open step, and a swap-in took the freed source. The node runs tier moves before copies, so
    "a"'s new block would have received the swapped-in content. (The rule and its other cases:
    step_order.py, test_core_step_order.py.)"""
    m = one_pool(8, host=8)
    m.allocate("x", "p", num_tokens=2 * BS)
    m.allocate("a", "p", num_tokens=BS + 1)          # a partial last block
    run_step(m)
    m.swap_out(["x"])
    m.fork("a", ["b"])
    run_step(m)
    (cow,) = m.append_tokens(["a"], [1]).copy_ops.values()
    m.free(["b"])                                    # the copy's source has no holder left
    m.swap_in(["x"])
    out = m.close_step("p")
    assert out is not None
    assert cow.src not in {op.dst for op in out.tier_ops if not op.to_host}


def test_an_aborted_unsent_plan_never_copies_over_a_swap_in_of_its_step() -> None:
    """The "reads back wrong tokens on the node" example of the same machine: a plan aborted
    by the admin in its own open step left its copies there; a swap-in of that step took its
    released destinations, and the node — tier moves first, then copies — overwrote them."""
    m = _swapped_with_unsent_plan()
    plan = m.get_defrag_plan("p")
    assert plan is not None
    m.abort_defrag(plan.plan_id)
    (view,) = m.swap_in(["a"])
    assert {op.dst for op in plan.moves} & set(view.block_table)   # the released destinations
    out = m.close_step("p")
    assert out is not None and out.copy_ops == () and out.plan_id is None
    assert m.fsck() == []
