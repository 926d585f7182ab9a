"""Defragmentation: planning, the plan → ack → commit / abort protocol, and the policy."""

from __future__ import annotations

import pytest

from block_manager.core import (
    AppendRequest,
    BlockManager,
    DefragPolicy,
    FailedPrecondition,
    InvalidRequest,
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
    m.free([f"s{i}" for i in range(0, num_blocks // 2, 2)])
    return m


def tables(m: BlockManager) -> dict[str, tuple[int, ...]]:
    return {v.seq_id: v.block_table for v in m.sequences("p")}


def ack_all(m: BlockManager, pool_id: str = "p") -> None:
    ops = m.pending_copy_ops(pool_id)
    if ops:
        m.ack_copy_ops(pool_id, ops[-1].op_id)


def test_compaction_lowers_high_water_mark_and_keeps_runs() -> None:
    m = scattered()
    assert m.metrics("p").high_water_mark == 16
    plan = m.plan_defrag("p", "compaction")
    assert plan is not None and plan.kind == "compaction"
    assert all(op.kind == "defrag" and op.dst < op.src for op in plan.moves)
    assert m.pending_copy_ops("p") == list(plan.moves)
    met = m.metrics("p")
    assert met.num_reserved_blocks == len(plan.moves)
    assert met.num_free_blocks + met.num_cached_blocks + met.num_used_blocks + \
        met.num_reserved_blocks == 16
    assert m.fsck() == []
    with pytest.raises(FailedPrecondition):
        m.commit_defrag(plan.plan_id)
    ack_all(m)
    before = tables(m)
    versions = {sid: m.get_sequence(sid).version for sid in before}
    changed = m.commit_defrag(plan.plan_id)
    after = tables(m)
    assert changed == [sid for sid in before if before[sid] != after[sid]]
    assert m.metrics("p").high_water_mark == 8
    for sid in changed:
        assert m.get_sequence(sid).version > versions[sid]
        t = after[sid]
        assert t[1] == t[0] + 1  # a run stays a run
    met = m.metrics("p")
    assert met.defrag_moves == len(plan.moves) and met.num_reserved_blocks == 0
    assert m.fsck() == []
    assert m.plan_defrag("p", "compaction") is None


def test_compaction_skips_partial_blocks_and_respects_max_moves() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    m.allocate("a", "p", num_tokens=16)  # 0..3
    m.allocate("b", "p", num_tokens=14)  # 4..7, block 7 partial
    m.free(["a"])
    plan = m.plan_defrag("p", max_moves=2)
    assert plan is not None
    assert [(op.src, op.dst) for op in plan.moves] == [(5, 0), (6, 1)]
    m.abort_defrag(plan.plan_id)
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
        m.commit_defrag(plan.plan_id + 1)
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


def test_abort_restores_everything_but_the_queued_copies() -> None:
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
    assert [op[0] for op in pool_after["copy_ops"]] == [op.op_id for op in plan.moves]
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
    ack_all(m)
    changed = m.commit_defrag(plan.plan_id)
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
    ack_all(m)
    changed = m.commit_defrag(plan.plan_id)
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
    m.free(["pad"])
    plan = m.plan_defrag("p")
    assert plan is not None
    assert {(op.src, op.dst) for op in plan.moves} == {(4, 0), (5, 1)}
    ack_all(m)
    m.commit_defrag(plan.plan_id)
    assert m.get_sequence("a").block_table == (0, 1, 6)
    hit = m.allocate("b", "p", list(range(9)))
    assert hit.num_cached_tokens == 8 and hit.block_table[:2] == (0, 1)
    m.free(["a", "b"])
    assert m.metrics("p").num_cached_blocks == 2
    assert m.fsck() == []


def test_prefix_hit_on_a_pinned_source_is_rewritten_at_commit() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 8, 4)
    m.allocate("pad", "p", num_tokens=8)  # 0, 1
    m.allocate("a", "p", list(range(9)))  # 2, 3, 4
    m.free(["pad"])
    plan = m.plan_defrag("p")
    assert plan is not None
    b = m.allocate("b", "p", list(range(9)))
    assert b.num_cached_tokens == 8
    ack_all(m)
    assert set(m.commit_defrag(plan.plan_id)) == {"a", "b"}
    assert m.get_sequence("a").block_table[:2] == m.get_sequence("b").block_table[:2]
    assert m.fsck() == []


def test_appends_during_the_plan_keep_working() -> None:
    m = scattered()
    plan = m.plan_defrag("p")
    assert plan is not None
    res = m.append_slots([AppendRequest(v.seq_id, 1) for v in m.sequences("p")])
    assert all(r.__class__.__name__ == "AppendResult" for r in res)
    ack_all(m)
    m.commit_defrag(plan.plan_id)
    assert m.fsck() == []


def test_contiguity_places_sequences_into_runs() -> None:
    m = BlockManager(watermark=0.0, defrag_policy=DefragPolicy(max_high_water_ratio=None))
    m.add_pool("p", 24, 4)
    for i in range(4):
        m.allocate(f"s{i}", "p", num_tokens=4)
    for _step in range(3):  # interleaved growth: s0=(0,4,8,12) etc.
        m.append_slots([AppendRequest(f"s{i}", 4) for i in range(4)])
    m.free(["s2", "s3"])
    assert m.metrics("p").contiguity == 0.0
    assert m.defrag_due("p") == "contiguity"
    plan = m.plan_defrag("p", "contiguity")
    assert plan is not None and plan.kind == "contiguity"
    ack_all(m)
    assert m.commit_defrag(plan.plan_id) == ["s0", "s1"]
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
    assert m.plan_defrag("p", "contiguity") is None  # no free run of 4


def test_defrag_due_policy() -> None:
    m = scattered(defrag_policy=DefragPolicy(every_n_steps=None, max_high_water_ratio=1.5,
                                             min_contiguity=None))
    assert m.defrag_due("p") == "compaction"  # hwm 16 / used 8
    plan = m.plan_defrag("p")
    assert plan is not None
    assert m.defrag_due("p") is None  # a plan is outstanding
    ack_all(m)
    m.commit_defrag(plan.plan_id)
    assert m.defrag_due("p") is None

    m2 = scattered(defrag_policy=DefragPolicy(every_n_steps=3, max_high_water_ratio=None,
                                              min_contiguity=None))
    assert m2.defrag_due("p") is None
    for _ in range(3):
        m2.append_slots([AppendRequest(v.seq_id, 1) for v in m2.sequences("p")])
    assert m2.defrag_due("p") == "compaction"
    plan = m2.plan_defrag("p")
    assert plan is not None
    ack_all(m2)
    m2.commit_defrag(plan.plan_id)
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
    ack_all(m)
    m.commit_defrag(plan.plan_id)
    # 8 free blocks: the 4 old sources are handed out only after the other 4.
    sources = {op.src for op in plan.moves}
    first = m.allocate("n1", "p", num_tokens=16).block_table
    assert not set(first) & sources
    assert m.metrics("p").high_water_mark == 14  # 8, 9, 12, 13 were the free holes
    second = m.allocate("n2", "p", num_tokens=16).block_table
    assert set(second) == sources
