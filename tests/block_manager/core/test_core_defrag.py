"""Defragmentation: planning, the plan → step → settle (commit) / abort protocol, and the policy."""

from __future__ import annotations

import pytest

from block_manager.core import (
    AppendRequest,
    BlockManager,
    DefragPolicy,
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    StepOutput,
    UnknownPlan,
    UnknownPool,
)


def scattered(num_blocks: int = 16, block_size: int = 4, **kw) -> BlockManager:
    """Eight 2-block sequences filling the pool, then every other one freed: live blocks
    are spread up to the top of the pool."""
    m = BlockManager(watermark=0.0, **kw)
    m.add_pool("p", num_blocks, block_size)
    for i in range(num_blocks // 2):
        m.allocate(f"s{i}", "p", num_tokens=2 * block_size)
    forward(m)  # the prompts' K/V is written: their full blocks may move
    m.free([f"s{i}" for i in range(0, num_blocks // 2, 2)])
    return m


def tables(m: BlockManager) -> dict[str, tuple[int, ...]]:
    return {v.seq_id: v.block_table for v in m.sequences("p")}


def forward(m: BlockManager) -> list[StepOutput]:
    """Close every pool's open step, run its Forward (nothing to run here), report it done."""
    outs = m.close_steps()
    for out in outs:
        m.settle_steps(out.pool_id, out.step_id)
    return outs


def commit(m: BlockManager) -> list[str]:
    """Run the step carrying the plan's moves and report it: the plan commits; its table
    rewrites are the next step's deltas (returned: the ids of the rewritten tables)."""
    forward(m)
    out = m.close_step("p", force=True)  # the rewrites alone: they would wait for the next write
    return [] if out is None else [d.seq_id for d in out.deltas]


def test_compaction_lowers_high_water_mark_and_keeps_runs() -> None:
    m = scattered()
    assert m.metrics("p").high_water_mark == 16
    plan = m.plan_defrag("p", "compaction")
    assert plan is not None and plan.kind == "compaction"
    assert all(op.kind == "defrag" and op.dst < op.src for op in plan.moves)
    met = m.metrics("p")
    assert met.num_reserved_blocks == len(plan.moves)
    assert met.num_free_blocks + met.num_cached_blocks + met.num_used_blocks + \
        met.num_reserved_blocks == 16
    assert m.fsck() == []
    before = tables(m)
    versions = {sid: m.get_sequence(sid).version for sid in before}
    (out,) = m.close_steps()
    assert out.copy_ops == plan.moves and out.plan_id == plan.plan_id  # the moves ride in the step
    assert tables(m) == before  # nothing switches before the step's Forward is reported
    settled = m.settle_steps("p", out.step_id)
    assert settled.committed_plan_ids == (plan.plan_id,)
    after = tables(m)
    changed = [d.seq_id for d in m.close_step("p", force=True).deltas]
    assert changed == [sid for sid in before if before[sid] != after[sid]]
    assert m.metrics("p").high_water_mark == 8
    for sid in changed:
        assert m.get_sequence(sid).version > versions[sid]
        t = after[sid]
        assert t[1] == t[0] + 1  # a run stays a run
    met = m.metrics("p")
    assert met.defrag_moves == len(plan.moves) and met.num_reserved_blocks == 0
    assert (met.compaction_plans, met.contiguity_plans, met.aborted_plans) == (1, 0, 0)
    assert m.fsck() == []
    assert m.plan_defrag("p", "compaction") is None


def test_compaction_skips_partial_blocks_and_respects_max_moves() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    m.allocate("a", "p", num_tokens=16)  # 0..3
    m.allocate("b", "p", num_tokens=14)  # 4..7, block 7 partial
    forward(m)
    m.free(["a"])
    plan = m.plan_defrag("p", max_moves=2)
    assert plan is not None
    assert [(op.src, op.dst) for op in plan.moves] == [(5, 0), (6, 1)]
    m.abort_defrag(plan.plan_id)
    assert m.metrics("p").aborted_plans == 1 and m.metrics("p").compaction_plans == 0
    plan = m.plan_defrag("p")
    assert plan is not None
    assert 7 not in [op.src for op in plan.moves]
    assert m.fsck() == []


def test_one_plan_per_pool_and_unknown_plan() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    assert m.get_defrag_plan("p") == plan
    with pytest.raises(FailedPrecondition):
        m.plan_defrag("p", "contiguity")
    with pytest.raises(UnknownPlan):
        m.abort_defrag(plan.plan_id + 1)
    with pytest.raises(InvalidRequest):
        m.plan_defrag("p", "sideways")  # type: ignore[arg-type]
    with pytest.raises(UnknownPool):
        m.plan_defrag("nope")
    m.abort_defrag(plan.plan_id)
    with pytest.raises(UnknownPlan):
        m.abort_defrag(plan.plan_id)
    assert m.get_defrag_plan("p") is None


def test_abort_restores_everything_and_takes_unsent_copies_out_of_the_open_step() -> None:
    m = scattered()
    before = m.to_snapshot()
    plan = m.plan_defrag("p")
    assert plan is not None
    m.abort_defrag(plan.plan_id)
    after = m.to_snapshot()
    pool_before, pool_after = before["pools"][0], after["pools"][0]
    for key in ("ref_cnt", "reserved", "pinned", "sequences", "num_used", "num_reserved"):
        assert pool_before[key] == pool_after[key]
    assert sorted(pool_before["free_list"]) == sorted(pool_after["free_list"])
    assert pool_after["step"]["copy_ops"] == []      # no node had them: test_core_swap_in_room.py
    assert pool_after["plan"] is None
    assert m.fsck() == []


def test_commit_rewrites_all_sharers_including_forks_made_during_the_plan() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    moved = {op.src: op.dst for op in plan.moves}
    sid = next(s for s, t in tables(m).items() if t[0] in moved)
    old_table = tables(m)[sid]
    m.fork(sid, ["child"])
    changed = commit(m)
    assert sid in changed and "child" in changed
    expected = tuple(moved.get(b, b) for b in old_table)
    assert m.get_sequence(sid).block_table == expected
    assert m.get_sequence("child").block_table == expected
    assert m.fsck() == []


def test_sources_freed_during_the_plan_are_held_then_released() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    src_owner = next(s for s, t in tables(m).items() if plan.moves[-1].src in t)
    assert set(tables(m)[src_owner]) <= {op.src for op in plan.moves}
    reserved_before = m.metrics("p").num_reserved_blocks
    m.free([src_owner])
    met = m.metrics("p")
    # The freed sources are held by the plan, not reusable.
    assert met.num_reserved_blocks == reserved_before + 2
    assert m.fsck() == []
    changed = commit(m)
    assert src_owner not in changed
    met = m.metrics("p")
    assert met.num_reserved_blocks == 0 and met.defrag_moves == len(plan.moves) - 2
    assert m.fsck() == []


def test_held_sources_released_on_abort() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    m.free([v.seq_id for v in m.sequences("p")])
    m.abort_defrag(plan.plan_id)
    met = m.metrics("p")
    assert met.num_free_blocks == 16 and met.num_reserved_blocks == 0
    assert m.fsck() == []


def test_hash_identity_moves_with_the_block() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    m.allocate("pad", "p", num_tokens=16)  # 0..3
    m.allocate("a", "p", list(range(9)))  # 4, 5 full+hashed, 6 partial
    forward(m)
    m.free(["pad"])
    plan = m.plan_defrag("p")
    assert plan is not None
    assert {(op.src, op.dst) for op in plan.moves} == {(4, 0), (5, 1)}
    commit(m)
    assert m.get_sequence("a").block_table == (0, 1, 6)
    hit = m.allocate("b", "p", list(range(9)))
    assert hit.num_cached_tokens == 8 and hit.block_table[:2] == (0, 1)
    forward(m)
    m.free(["a", "b"])
    assert m.metrics("p").num_cached_blocks == 2
    assert m.fsck() == []


def test_prefix_hit_on_a_pinned_source_is_rewritten_at_commit() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    m.allocate("pad", "p", num_tokens=8)  # 0, 1
    m.allocate("a", "p", list(range(9)))  # 2, 3, 4
    forward(m)
    m.free(["pad"])
    plan = m.plan_defrag("p")
    assert plan is not None
    b = m.allocate("b", "p", list(range(9)))
    assert b.num_cached_tokens == 8
    forward(m)
    # b's table is announced in the plan's step with the source blocks; the commit rewrites it
    assert set(d.seq_id for d in m.close_step("p", force=True).deltas) == {"a", "b"}
    assert m.get_sequence("a").block_table[:2] == m.get_sequence("b").block_table[:2]
    assert m.fsck() == []


def test_appends_during_the_plan_keep_working() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    res = m.append_slots([AppendRequest(v.seq_id, 1) for v in m.sequences("p")])
    assert all(r.__class__.__name__ == "AppendResult" for r in res)
    commit(m)
    assert m.get_defrag_plan("p") is None and m.metrics("p").defrag_moves == len(plan.moves)
    assert m.fsck() == []


def test_contiguity_places_sequences_into_runs() -> None:
    m = BlockManager(watermark=0.0, defrag_policy=DefragPolicy(max_high_water_ratio=None))
    m.add_pool("p", 24, 4)
    for i in range(4):
        m.allocate(f"s{i}", "p", num_tokens=4)
    for _step in range(3):  # interleaved growth: s0=(0,4,8,12) etc.
        m.append_slots([AppendRequest(f"s{i}", 4) for i in range(4)])
    forward(m)
    m.free(["s2", "s3"])
    assert m.metrics("p").contiguity == 0.0
    assert m.defrag_due("p") == "contiguity"
    plan = m.plan_defrag("p", "contiguity")
    assert plan is not None and plan.kind == "contiguity"
    assert commit(m) == ["s0", "s1"]
    for sid in ("s0", "s1"):
        t = m.get_sequence(sid).block_table
        assert list(t) == list(range(t[0], t[0] + 4))
        assert t[0] >= 14  # 14..23 is the only free run long enough
    assert m.metrics("p").contiguity == 1.0
    assert m.plan_defrag("p", "contiguity") is None
    assert m.fsck() == []


def test_contiguity_only_when_a_run_fits() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    for i in range(2):
        m.allocate(f"s{i}", "p", num_tokens=4)
    for _ in range(3):
        m.append_slots([AppendRequest(f"s{i}", 4) for i in range(2)])
    forward(m)
    assert m.plan_defrag("p", "contiguity") is None  # no free run of 4


def test_defrag_due_policy() -> None:
    m = scattered(defrag_policy=DefragPolicy(every_n_steps=None, max_high_water_ratio=1.5,
                                             min_contiguity=None))
    assert m.defrag_due("p") == "compaction"  # hwm 16 / used 8
    plan = m.plan_defrag("p")
    assert plan is not None
    assert m.defrag_due("p") is None  # a plan is outstanding
    commit(m)
    assert m.defrag_due("p") is None

    m2 = scattered(defrag_policy=DefragPolicy(every_n_steps=3, max_high_water_ratio=None,
                                              min_contiguity=None))
    assert m2.defrag_due("p") is None
    for _ in range(3):
        m2.append_slots([AppendRequest(v.seq_id, 1) for v in m2.sequences("p")])
    forward(m2)
    assert m2.defrag_due("p") == "compaction"
    plan = m2.plan_defrag("p")
    assert plan is not None
    forward(m2)
    assert m2.defrag_due("p") is None  # step counter restarts at commit


@pytest.mark.parametrize(
    "kwargs",
    [{"every_n_steps": 0}, {"every_n_steps": 1.5}, {"max_high_water_ratio": 0.5},
     {"min_contiguity": 1.5}, {"min_contiguity": "x"}],
)
def test_bad_policy_is_rejected(kwargs) -> None:
    with pytest.raises(InvalidRequest):
        DefragPolicy(**kwargs)


def test_compacted_sources_are_reused_last() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    commit(m)
    # 8 free blocks: the 4 old sources are handed out only after the other 4.
    sources = {op.src for op in plan.moves}
    first = m.allocate("n1", "p", num_tokens=16).block_table
    assert not set(first) & sources
    assert m.metrics("p").high_water_mark == 14  # 8, 9, 12, 13 were the free holes
    second = m.allocate("n2", "p", num_tokens=16).block_table
    assert set(second) == sources


def test_blocks_whose_step_is_unreported_never_move() -> None:
    """The defrag race: a block counts as full as soon as allocate/append returns, but its K/V
    is written only by the Forward of the step. A plan made in between must not move it."""
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    m.allocate("pad", "p", num_tokens=8)  # 0, 1
    forward(m)
    m.allocate("a", "p", list(range(8)))  # 2, 3: full, but not written yet
    m.free(["pad"])
    assert m.defrag_due("p") is None
    assert m.plan_defrag("p") is None
    (out,) = m.close_steps()
    assert m.plan_defrag("p") is None  # closed but not reported: still unwritten
    m.settle_steps("p", out.step_id)
    plan = m.plan_defrag("p")
    assert plan is not None and {(op.src, op.dst) for op in plan.moves} == {(2, 0), (3, 1)}
    assert m.fsck() == []


def test_a_failed_step_aborts_its_plan_and_drops_what_it_wrote() -> None:
    m = scattered()
    survivor = next(iter(tables(m)))
    plan = m.plan_defrag("p")
    assert plan is not None
    m.allocate("new", "p", list(range(9)))  # writes blocks and registers two hashes
    m.append_slots([AppendRequest(survivor, 1)])
    before_tables = {s: t for s, t in tables(m).items() if s not in ("new", survivor)}
    (out,) = m.close_steps()
    settled = m.settle_steps("p", out.step_id - 1, failed_from=out.step_id)
    assert settled.aborted_plan_ids == (plan.plan_id,)
    assert set(settled.dropped_seq_ids) == {"new", survivor}
    assert tables(m) == before_tables and m.get_defrag_plan("p") is None
    assert m.metrics("p").num_reserved_blocks == 0
    # the failed step's blocks never became prefix hits
    assert m.allocate("again", "p", list(range(9))).num_cached_tokens == 0
    (nxt,) = m.close_steps()
    # the node may have applied the failed step's deltas before failing: both are dropped there
    assert set(nxt.dropped_seq_ids) == {"new", survivor}
    assert m.fsck() == []


def test_settle_validation() -> None:
    m = scattered()
    m.allocate("x", "p", num_tokens=3)
    (out,) = m.close_steps()
    with pytest.raises(FailedPrecondition):
        m.settle_steps("p", out.step_id + 1)  # never handed out
    with pytest.raises(InvalidRequest):
        m.settle_steps("p", out.step_id, failed_from=out.step_id)  # both
    m.settle_steps("p", out.step_id)
    m.settle_steps("p", out.step_id)  # a repeated report is a no-op
    with pytest.raises(InvalidRequest):
        m.settle_steps("p", 0, failed_from=out.step_id)  # already reported complete
    assert m.fsck() == []


def test_unsettled_steps_are_bounded() -> None:
    m = BlockManager(watermark=0.0, max_unsettled_steps=2)
    m.add_pool("p", 8, 4)
    for i in range(2):
        m.allocate(f"s{i}", "p", num_tokens=2)
        m.close_step("p")
    m.allocate("s2", "p", num_tokens=2)
    assert not m.can_close_step("p")
    with pytest.raises(FailedPrecondition):
        m.close_step("p")
    m.settle_steps("p", 1)
    assert m.close_step("p") is not None and m.unsettled_step_ids("p") == [2, 3]
    assert m.fsck() == []


def test_a_plan_no_node_has_yields_its_blocks_to_an_admission() -> None:
    """A pool's open step closes only with token work, so a plan made as the pool's last
    running sequences finished would hold its reserved blocks until new work came; work that
    needs exactly those blocks (an admission, a swap-in) would wait forever. Such a plan —
    still in the open step, its copies with no node — is aborted when the blocks are needed,
    its copies taken out of the step with it; the usable count says so beforehand."""
    m = scattered()
    plan = m.plan_defrag("p", "compaction")
    assert plan is not None
    m.free([f"s{i}" for i in range(1, 8, 2)])   # the plan's sources' holders finish
    met = m.metrics("p")
    assert met.num_free_blocks + met.num_cached_blocks < 16       # the plan holds blocks
    assert m.free_blocks("p")[1] == 16                             # ... that an allocation may take
    m.allocate("big", "p", num_tokens=16 * 4)                      # all 16 blocks
    assert m.get_defrag_plan("p") is None
    (out,) = m.close_steps()
    assert out.copy_ops == () and out.plan_id is None              # no move overwrites "big"'s blocks
    assert m.fsck() == []


def test_a_plan_a_node_has_keeps_its_blocks() -> None:
    m = scattered()
    plan = m.plan_defrag("p", "compaction")
    assert plan is not None
    m.close_steps()                                                # its copies are with the node now
    free = m.free_blocks("p")[1]
    with pytest.raises(OutOfBlocks, match="blocks needed"):
        m.allocate("big", "p", num_tokens=(free + 1) * 4)
    assert m.get_defrag_plan("p") is not None
    assert m.fsck() == []
