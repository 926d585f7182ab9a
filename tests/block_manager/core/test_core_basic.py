"""Unit tests of allocate / append / fork / free and their error paths."""

from __future__ import annotations

import pytest

from block_manager.core import (
    AppendFailure,
    AppendRequest,
    AppendResult,
    BlockManager,
    InvalidRequest,
    OutOfBlocks,
    PendingWrite,
    PoolDraining,
    SequenceExists,
    UnknownPool,
    UnknownSequence,
)


def make(num_blocks: int = 16, block_size: int = 4, **kw) -> BlockManager:
    m = BlockManager(watermark=kw.pop("watermark", 0.0), **kw)
    m.add_pool("p", num_blocks, block_size)
    return m


def forward(m: BlockManager) -> list:
    """What a scheduler does between steps: close every pool's step, run its Forward (here:
    nothing to run), report it complete."""
    outs = m.close_steps()
    for out in outs:
        m.settle_steps(out.pool_id, out.step_id)
    return outs


def _num_steps(m: BlockManager) -> int:
    (pool,) = m.to_snapshot()["pools"]
    return int(pool["num_steps"])


def test_append_slots_with_and_without_token_ids_counts_one_step() -> None:
    m = make()
    for sid in "abc":
        m.allocate(sid, "p", [1, 2, 3])
    before = _num_steps(m)
    # mixed: some items carry token ids, one does not (applied one run at a time inside)
    res = m.append_slots([AppendRequest("a", 1, (4,)), AppendRequest("b", 2), AppendRequest("c", 1, (9,))])
    assert all(isinstance(r, AppendResult) for r in res)
    assert _num_steps(m) == before + 1
    m.append_slots([AppendRequest("a", 1, (5,)), AppendRequest("b", 1, (6,))])
    assert _num_steps(m) == before + 2


def test_allocate_fresh_prompt_gets_slots_for_every_token() -> None:
    m = make()
    r = m.allocate("a", "p", list(range(10)))
    assert r.block_table == (0, 1, 2)
    assert r.num_cached_tokens == 0
    assert r.slot_mapping == tuple(range(10))
    assert r.version == 1
    assert m.fsck() == []


def test_allocate_num_tokens_only() -> None:
    m = make()
    r = m.allocate("a", "p", num_tokens=5)
    assert len(r.block_table) == 2
    assert len(r.slot_mapping) == 5
    # No tokens: no hashing, so an identical prompt later cannot hit.
    r2 = m.allocate("b", "p", num_tokens=5)
    assert r2.num_cached_tokens == 0


def test_prefix_hit_shares_full_blocks() -> None:
    m = make()
    a = m.allocate("a", "p", list(range(10)))
    # Admitted in the same step: a's full blocks are filled by this step's Forward, whose K/V
    # writes precede its attention, so they are shared (as vLLM shares them), not recomputed.
    same_step = m.allocate("early", "p", list(range(10)))
    assert same_step.num_cached_tokens == 8
    assert same_step.block_table[:2] == a.block_table[:2]
    (out,) = m.close_steps()
    # That step is in flight (closed, not reported): its blocks are no hit for the next one.
    in_flight = m.allocate("late", "p", list(range(10)))
    assert in_flight.num_cached_tokens == 0
    m.settle_steps(out.pool_id, out.step_id)
    b = m.allocate("b", "p", list(range(10)))
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    bs = 4
    assert b.slot_mapping == tuple(b.block_table[2] * bs + i for i in range(2))
    met = m.metrics("p")
    assert met.prefix_query_tokens == 40 and met.prefix_hit_tokens == 16
    assert m.fsck() == []


def test_full_prompt_hit_keeps_last_token_to_compute() -> None:
    m = make()
    m.allocate("a", "p", list(range(8)))
    forward(m)
    b = m.allocate("b", "p", list(range(8)))
    assert b.num_cached_tokens == 4
    assert len(b.slot_mapping) == 4


def test_salt_isolates_tenants() -> None:
    m = make()
    m.allocate("a", "p", list(range(9)), salt="t1")
    forward(m)
    assert m.allocate("b", "p", list(range(9)), salt="t2").num_cached_tokens == 0
    assert m.allocate("c", "p", list(range(9)), salt="t1").num_cached_tokens == 8
    assert m.allocate("d", "p", list(range(9))).num_cached_tokens == 0


def test_prefix_caching_switch_off() -> None:
    m = make(enable_prefix_caching=False)
    m.allocate("a", "p", list(range(9)))
    assert m.allocate("b", "p", list(range(9))).num_cached_tokens == 0
    assert m.metrics("p").prefix_query_tokens == 0


def test_freed_hashed_blocks_stay_cached_and_are_reused() -> None:
    m = make()
    a = m.allocate("a", "p", list(range(10)))
    forward(m)  # the writes run before the free
    m.free(["a"])
    met = m.metrics("p")
    assert met.num_cached_blocks == 2 and met.num_free_blocks == 14 and met.num_used_blocks == 0
    b = m.allocate("b", "p", list(range(10)))
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert m.fsck() == []


def test_eviction_order_tail_first_and_counted() -> None:
    m = make(num_blocks=5)
    m.allocate("a", "p", list(range(12)))  # 3 full hashed blocks 0,1,2
    forward(m)  # the writes run before the free
    m.free(["a"])
    assert m.metrics("p").num_cached_blocks == 3
    # Needs 3 blocks: the free ones (3, 4) first, then evicts a's tail block (2).
    r = m.allocate("b", "p", num_tokens=12)
    assert r.block_table == (3, 4, 2)
    assert m.metrics("p").evictions == 1
    forward(m)  # the writes run before the free
    m.free(["b"])
    # a's first two blocks are still a usable prefix.
    assert m.allocate("c", "p", list(range(9))).num_cached_tokens == 8
    assert m.fsck() == []


def test_allocate_errors_leave_state_unchanged() -> None:
    m = make(num_blocks=4)
    m.allocate("a", "p", list(range(5)))
    before = m.to_snapshot()
    cases = [
        (lambda: m.allocate("a", "p", [1]), SequenceExists),
        (lambda: m.allocate("x", "nope", [1]), UnknownPool),
        (lambda: m.allocate("x", "p"), InvalidRequest),
        (lambda: m.allocate("x", "p", [1], num_tokens=1), InvalidRequest),
        (lambda: m.allocate("x", "p", []), InvalidRequest),
        (lambda: m.allocate("x", "p", num_tokens=0), InvalidRequest),
        (lambda: m.allocate("x", "p", num_tokens=-3), InvalidRequest),
        (lambda: m.allocate("x", "p", ["a"]), InvalidRequest),
        (lambda: m.allocate("x", "p", [1 << 70]), InvalidRequest),
        (lambda: m.allocate("x", "p", [1], salt=3), InvalidRequest),
        (lambda: m.allocate("", "p", [1]), InvalidRequest),
        (lambda: m.allocate("x", "p", list(range(100))), OutOfBlocks),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
        assert m.to_snapshot() == before


def test_out_of_blocks_with_partial_prefix_hit_changes_nothing() -> None:
    m = make(num_blocks=4)
    m.allocate("a", "p", list(range(8)))
    forward(m)  # the writes run before the free
    m.free(["a"])  # two cached blocks
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks):
        m.allocate("b", "p", list(range(8)) + list(range(100, 113)))
    assert m.to_snapshot() == before


def test_watermark_admission_but_appends_use_reserve() -> None:
    m = BlockManager(watermark=0.25)
    m.add_pool("p", 8, 4)  # reserve: 2 blocks
    assert m.can_allocate("p", 24)
    assert not m.can_allocate("p", 25)
    m.allocate("a", "p", num_tokens=24)  # 6 blocks, leaves 2
    with pytest.raises(OutOfBlocks):
        m.allocate("b", "p", num_tokens=1)
    res = m.append_slots([AppendRequest("a", 8)])
    assert isinstance(res[0], AppendResult) and len(res[0].new_block_ids) == 2
    assert m.metrics("p").num_free_blocks == 0


def test_draining_pool_refuses_allocate() -> None:
    m = make()
    m.set_draining("p", True)
    assert not m.can_allocate("p", 1)
    with pytest.raises(PoolDraining):
        m.allocate("a", "p", [1])
    m.set_draining("p", False)
    m.allocate("a", "p", [1])


def test_append_decode_within_block_and_across_boundary() -> None:
    m = make()
    m.allocate("a", "p", list(range(3)))
    (r,) = m.append_slots([AppendRequest("a", 1, (3,))])
    assert isinstance(r, AppendResult)
    assert r.slot_mapping == (3,) and r.new_block_ids == () and r.version == 1 and r.num_tokens == 4
    (r,) = m.append_slots([AppendRequest("a", 1, (4,))])
    assert r.new_block_ids == (1,) and r.slot_mapping == (4,) and r.version == 2
    (r,) = m.append_slots([AppendRequest("a", 6)])
    assert r.slot_mapping == (5, 6, 7, 8, 9, 10) and r.new_block_ids == (2,)
    assert m.get_sequence("a").block_table == (0, 1, 2)
    assert m.fsck() == []


def test_append_hashes_blocks_as_they_fill() -> None:
    m = make()
    m.allocate("a", "p", [0, 1, 2])
    m.append_slots([AppendRequest("a", 3, (3, 4, 5))])
    m.append_slots([AppendRequest("a", 3, (6, 7, 8))])
    forward(m)
    # Same content as a prompt: blocks 0..1 hit.
    assert m.allocate("b", "p", list(range(9))).num_cached_tokens == 8
    # Without tokens hashing stops for "a".
    m.append_slots([AppendRequest("a", 3)])
    m.append_slots([AppendRequest("a", 1, (12,))])
    forward(m)
    assert m.allocate("c", "p", list(range(13))).num_cached_tokens == 8
    assert m.fsck() == []


def test_append_per_sequence_failures_leave_those_sequences_unchanged() -> None:
    m = make(num_blocks=8)
    for sid in "abcdef":
        m.allocate(sid, "p", [1, 2, 3, 4])
    m.fork("f", ["g"])
    before = {v.seq_id: v for v in m.sequences()}
    res = m.append_slots([
        AppendRequest("a", 1, (9,)),
        AppendRequest("zz", 1),
        AppendRequest("b", 0),
        AppendRequest("c", 2, (1,)),
        AppendRequest("d", 100),
        AppendRequest("e", 1, ("x",)),  # type: ignore[arg-type]
        AppendRequest("a", 1),
        AppendRequest("f", 1, (1,)),
    ])
    assert isinstance(res[0], AppendResult) and isinstance(res[7], AppendResult)
    assert all(isinstance(r, AppendFailure) for r in res[1:7])
    kinds = [type(r.error) for r in res[1:7]]  # type: ignore[union-attr]
    assert kinds == [UnknownSequence, InvalidRequest, InvalidRequest, OutOfBlocks,
                     InvalidRequest, InvalidRequest]
    for sid in "bcde":
        assert m.get_sequence(sid) == before[sid]
    assert m.get_sequence("a").num_tokens == 5
    assert m.fsck() == []


def test_append_out_of_blocks_for_copy_on_write_changes_nothing() -> None:
    m = make(num_blocks=2)
    m.allocate("a", "p", [1, 2, 3, 4, 5])  # blocks 0, 1 (partial)
    forward(m)
    m.fork("a", ["b"])
    before = m.to_snapshot()
    (r,) = m.append_slots([AppendRequest("b", 1, (6,))])
    assert isinstance(r, AppendFailure) and isinstance(r.error, OutOfBlocks)
    assert m.to_snapshot() == before


def test_fork_shares_then_copy_on_write() -> None:
    m = make()
    a = m.allocate("a", "p", list(range(6)))
    (c,) = m.fork("a", ["c"])
    # versions come from one per-pool counter: a reused seq id never repeats a version
    assert c.block_table == (0, 1) and c.num_tokens == 6 and c.version > a.version
    met = m.metrics("p")
    assert met.num_used_blocks == 2 and met.waste_slots == 2
    # The shared partial block is not written until the Forward of its step is reported:
    # copying it now would copy unwritten memory.
    (pending,) = m.append_slots([AppendRequest("c", 1, (6,))])
    assert isinstance(pending, AppendFailure) and isinstance(pending.error, PendingWrite)
    forward(m)
    (r,) = m.append_slots([AppendRequest("c", 1, (6,))])
    assert len(r.copy_ops) == 1
    op = r.copy_ops[0]
    assert (op.src, op.kind) == (1, "cow") and op.dst not in (0, 1)
    assert r.slot_mapping == (op.dst * 4 + 2,)
    assert m.get_sequence("c").block_table == (0, op.dst) and r.version > c.version
    # The parent now owns block 1 alone: no copy.
    (r2,) = m.append_slots([AppendRequest("a", 1, (6,))])
    assert r2.copy_ops == () and r2.slot_mapping == (6,)
    (out,) = m.close_steps()
    assert out.copy_ops == (op,)
    assert [(d.seq_id, d.replaced, d.appended) for d in out.deltas] == [("c", ((1, op.dst),), ())]
    assert m.metrics("p").cow_copies == 1
    assert m.fsck() == []


def test_fork_children_inherit_hashing() -> None:
    m = make()
    m.allocate("a", "p", list(range(6)))
    forward(m)
    m.fork("a", ["c"])
    m.append_slots([AppendRequest("c", 2, (6, 7))])
    forward(m)
    assert m.allocate("d", "p", list(range(9))).num_cached_tokens == 8


def test_fork_errors() -> None:
    m = make()
    m.allocate("a", "p", [1])
    m.allocate("b", "p", [1])
    before = m.to_snapshot()
    for call, exc in [
        (lambda: m.fork("zz", ["c"]), UnknownSequence),
        (lambda: m.fork("a", []), InvalidRequest),
        (lambda: m.fork("a", ["c", "c"]), InvalidRequest),
        (lambda: m.fork("a", ["c", "b"]), SequenceExists),
        (lambda: m.fork("a", ["c", ""]), InvalidRequest),
    ]:
        with pytest.raises(exc):
            call()
        assert m.to_snapshot() == before


def test_free_validates_everything_first() -> None:
    m = make()
    m.allocate("a", "p", [1])
    m.allocate("b", "p", [1])
    before = m.to_snapshot()
    with pytest.raises(PendingWrite):  # their prompts are written by this step's Forward
        m.free(["a"])
    assert m.to_snapshot() == before
    forward(m)
    before = m.to_snapshot()
    with pytest.raises(UnknownSequence):
        m.free(["a", "zz"])
    with pytest.raises(InvalidRequest):
        m.free(["a", "a"])
    assert m.to_snapshot() == before
    m.free(["a", "b"])
    with pytest.raises(UnknownSequence):
        m.free(["a"])
    assert m.metrics("p").num_free_blocks == 16


def test_free_everything_returns_all_blocks() -> None:
    m = make()
    m.allocate("a", "p", list(range(10)))
    forward(m)
    m.fork("a", ["b", "c"])
    m.append_slots([AppendRequest("b", 3, (1, 2, 3)), AppendRequest("c", 1, (5,))])
    forward(m)  # the writes run before the free
    m.free(["a", "b", "c"])
    met = m.metrics("p")
    assert met.num_used_blocks == 0 and met.num_free_blocks + met.num_cached_blocks == 16
    assert m.fsck() == []


def test_get_tables_only_newer() -> None:
    m = make()
    va = m.allocate("a", "p", [1, 2, 3, 4]).version
    vb = m.allocate("b", "p", [1]).version
    assert [v.seq_id for v in m.get_tables(["a", "b"], {"a": va})] == ["b"]
    m.append_slots([AppendRequest("a", 1)])
    assert [v.seq_id for v in m.get_tables(["a", "b"], {"a": va, "b": vb})] == ["a"]


def test_versions_never_repeat_when_a_seq_id_is_reused() -> None:
    """A compute node may still cache the table of a freed sequence; a new sequence with
    the same id must get a newer version so the node refetches instead of aliasing."""
    m = make()
    first = m.allocate("a", "p", [1, 2, 3, 4, 5])
    (r,) = m.append_slots([AppendRequest("a", 4)])
    forward(m)  # the writes run before the free
    m.free(["a"])
    second = m.allocate("a", "p", [9])
    assert second.version > r.version > first.version
    assert m.fsck() == []
    with pytest.raises(UnknownSequence):
        m.get_tables(["a", "zz"])


def test_pools_and_route() -> None:
    m = BlockManager(watermark=0)
    m.add_pool("n1", 16, 4)
    m.add_pool("n2", 32, 4)
    m.add_pool("n3", 8, 8)
    with pytest.raises(InvalidRequest):
        m.add_pool("n1", 4, 4)
    for bad in [("x", 0, 4), ("x", 4, 0), ("", 4, 4), ("x", 4.0, 4), ("x", True, 4)]:
        with pytest.raises(InvalidRequest):
            m.add_pool(*bad)  # type: ignore[arg-type]
    prompt = list(range(20))
    assert [e.pool_id for e in m.route(prompt)] == ["n2", "n1", "n3"]
    m.allocate("a", "n1", prompt)
    # filled by the open step: an admission in it shares them (written before attention reads)
    assert m.route(prompt + [7])[0].num_cached_tokens == 20
    (out, *_) = m.close_steps()
    assert m.route(prompt + [7])[0].num_cached_tokens == 0   # in flight: nothing to hit yet
    m.settle_steps(out.pool_id, out.step_id)
    ranked = m.route(prompt + [7])
    assert ranked[0].pool_id == "n1" and ranked[0].num_cached_tokens == 20
    m.set_draining("n1", True)
    assert "n1" not in [e.pool_id for e in m.route(prompt)]
    assert m.remove_pool("n1") == ["a"]
    with pytest.raises(UnknownSequence):
        m.get_sequence("a")
    assert m.fsck() == []


def test_copy_ops_ride_in_their_step_in_order() -> None:
    m = make()
    m.allocate("a", "p", [1, 2])
    forward(m)
    m.fork("a", ["b", "c"])
    m.append_slots([AppendRequest("b", 1), AppendRequest("c", 1)])
    (out,) = m.close_steps()
    assert [o.op_id for o in out.copy_ops] == [1, 2] and out.step_id == 2
    assert [d.seq_id for d in out.deltas] == ["b", "c"]
    assert all(d.base_version == 0 and d.num_tokens == 2 for d in out.deltas)  # new tables
    assert m.close_steps() == []  # nothing new: no step
    assert m.unsettled_step_ids("p") == [2] and m.settled_step_id("p") == 1


def test_evict_and_reset_prefix_cache() -> None:
    m = make()
    m.allocate("a", "p", list(range(12)))
    m.allocate("b", "p", list(range(50, 58)))
    forward(m)  # the writes run before the free
    m.free(["a"])
    assert m.evict("p", 1) == 1
    assert m.metrics("p").num_cached_blocks == 2
    assert m.reset_prefix_cache() == 2
    met = m.metrics("p")
    assert met.num_cached_blocks == 0 and met.num_free_blocks == 14
    forward(m)  # the writes run before the free
    m.free(["b"])  # its hashes were dropped too: freed, not cached
    assert m.metrics("p").num_cached_blocks == 0
    assert m.allocate("c", "p", list(range(12))).num_cached_tokens == 0
    assert m.fsck() == []


def test_can_append() -> None:
    m = make(num_blocks=2)
    m.allocate("a", "p", [1, 2, 3])
    assert m.can_append("a", 5)
    assert not m.can_append("a", 6)
    m.fork("a", ["b"])
    assert not m.can_append("a", 1)  # the copy's source is not written yet
    forward(m)
    assert m.can_append("a", 1)  # one block for the copy
    assert not m.can_append("a", 2)
    with pytest.raises(UnknownSequence):
        m.can_append("zz", 1)


def test_constructor_and_argument_validation() -> None:
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(InvalidRequest):
            BlockManager(watermark=bad)  # type: ignore[arg-type]
    m = make()
    with pytest.raises(InvalidRequest):
        m.evict("p", -1)
    with pytest.raises(UnknownPool):
        m.reset_prefix_cache("nope")
    with pytest.raises(UnknownPool):
        m.metrics("nope")
    with pytest.raises(InvalidRequest):
        m.route([])
    with pytest.raises(InvalidRequest):
        m.can_allocate("p", 0)


def test_metrics_waste_usage_and_high_water() -> None:
    m = make(num_blocks=10, block_size=4)
    m.allocate("a", "p", num_tokens=5)  # blocks 0, 1 (1 of 4 used)
    m.allocate("b", "p", num_tokens=8)  # blocks 2, 3 full
    m.fork("a", ["a2"])  # shares the partial block: waste counted once
    met = m.metrics("p")
    assert met.num_used_blocks == 4 and met.allocated_slots == 16
    assert met.num_tokens == 18 and met.waste_slots == 3
    assert met.usage == pytest.approx(0.4) and met.high_water_mark == 4
    assert met.num_sequences == 3
    assert met.contiguity == 1.0
    forward(m)  # the writes run before the free
    m.free(["a", "a2"])
    met = m.metrics("p")
    assert met.high_water_mark == 4 and met.waste_slots == 0 and met.num_used_blocks == 2


def test_cow_source_reused_before_the_copy_ran_is_safe_when_ops_run_first() -> None:
    """The node contract: a step's copy ops run before the step's writes."""
    m = make(num_blocks=3)
    mem: dict[int, int] = {}
    a = m.allocate("a", "p", [1, 2, 3])
    mem.update(zip(a.slot_mapping, [1, 2, 3]))
    forward(m)
    m.fork("a", ["b"])
    (rb,) = m.append_slots([AppendRequest("b", 1, (9,))])
    (op,) = rb.copy_ops
    m.free(["a"])  # the CoW source loses its last holder before the node copied it
    c = m.allocate("c", "p", [7, 7, 7])
    assert c.block_table == (op.src,)  # ... and is handed out again in the same step
    (out,) = m.close_steps()
    for pending in out.copy_ops:  # the node: the step's ops first ...
        for off in range(4):
            if pending.src * 4 + off in mem:
                mem[pending.dst * 4 + off] = mem[pending.src * 4 + off]
    mem[rb.slot_mapping[0]] = 9  # ... then the step's writes
    mem.update(zip(c.slot_mapping, [7, 7, 7]))
    b = m.get_sequence("b")
    assert [mem[b.block_table[0] * 4 + i] for i in range(4)] == [1, 2, 3, 9]
    assert [mem[op.src * 4 + i] for i in range(3)] == [7, 7, 7]


def test_integer_like_token_ids_are_accepted_and_hashed_like_ints() -> None:
    np = pytest.importorskip("numpy")
    m = make()
    m.allocate("a", "p", np.arange(3))
    (r,) = m.append_slots([AppendRequest("a", 6, tuple(np.arange(3, 9)))])
    assert isinstance(r, AppendResult) and r.num_tokens == 9
    (bad,) = m.append_slots([AppendRequest("a", 1, (True,))])
    assert isinstance(bad, AppendFailure) and isinstance(bad.error, InvalidRequest)
    forward(m)
    assert m.allocate("b", "p", list(range(9))).num_cached_tokens == 8
    assert m.fsck() == []


def test_get_tables_rejects_versions_from_the_future() -> None:
    from block_manager.core import VersionConflict

    m = make()
    m.allocate("a", "p", [1])
    with pytest.raises(VersionConflict):
        m.get_tables(["a"], {"a": 2})


def test_remove_pool_drops_its_plan_and_ops() -> None:
    m = make()
    m.allocate("pad", "p", num_tokens=8)
    m.allocate("a", "p", num_tokens=8)
    forward(m)
    m.free(["pad"])
    plan = m.plan_defrag("p")
    assert plan is not None
    m.remove_pool("p")
    from block_manager.core import UnknownPlan

    with pytest.raises(UnknownPlan):
        m.abort_defrag(plan.plan_id)
    with pytest.raises(UnknownPool):
        m.close_step("p")
    assert m.sequences() == [] and m.fsck() == []


def test_chunked_prefill_takes_slots_for_one_chunk_and_appends_the_rest() -> None:
    m = make()
    prompt = list(range(30))
    m.allocate("a", "p", prompt)
    forward(m)
    m.free(["a"])  # 7 full blocks cached
    r = m.allocate("b", "p", prompt + [99, 98], num_compute=5)
    assert r.num_cached_tokens == 28 and len(r.slot_mapping) == 4  # only 4 prompt tokens remain
    c = m.allocate("c", "p", list(range(100, 120)), num_compute=6)
    assert c.num_cached_tokens == 0 and len(c.slot_mapping) == 6 and m.get_sequence("c").num_tokens == 6
    (rest,) = m.append_slots([AppendRequest("c", 14, tuple(range(106, 120)))])
    assert rest.num_tokens == 20
    forward(m)
    # the chunks were hashed as they filled: the whole prompt is a prefix hit now
    assert m.allocate("d", "p", list(range(100, 121))).num_cached_tokens == 20
    with pytest.raises(InvalidRequest):
        m.allocate("e", "p", [1, 2], num_compute=0)
    assert m.fsck() == []


def test_already_written_tokens_stay_inside_the_partial_block() -> None:
    """Tokens a scheduler wrote into an exclusive partial block without asking (decode
    appends it answered locally) are reported later: same slots, no step work."""
    m = make()
    m.allocate("a", "p", [1, 2, 3, 4, 5])  # block 1 holds 1 token
    (out,) = m.close_steps()
    m.settle_steps("p", out.step_id)
    (r,) = m.append_slots([AppendRequest("a", 2, (6, 7))], already_written=True)
    assert r.slot_mapping == (5, 6) and r.num_tokens == 7
    assert m.close_steps() == []  # nothing for a Forward to do
    for bad in (AppendRequest("a", 1, (8,)), AppendRequest("a", 5, (8,) * 5)):
        (f,) = m.append_slots([bad], already_written=True)  # would fill / cross the block
        assert isinstance(f, AppendFailure) and isinstance(f.error, InvalidRequest)
    assert m.get_sequence("a").num_tokens == 7 and m.fsck() == []


def test_append_tokens_columnar() -> None:
    """The columnar append the Step RPC uses: flat token ids, per-item failures by index,
    token counts after; a malformed batch is checked item by item with the same errors."""
    m = make(num_blocks=8)
    for sid in "abc":
        m.allocate(sid, "p", [1, 2, 3])
    forward(m)
    out = m.append_tokens(["a", "b", "c"], [1, 2, 1], [7, 8, 9, 10])
    assert out.num_tokens == [4, 5, 4] and out.failures == [] and out.copy_ops == {}
    assert m.get_sequence("b").num_tokens == 5 and len(m.get_sequence("b").block_table) == 2
    before = m.to_snapshot()
    out = m.append_tokens(["a", "zz", "c", "a"], [1, 1, 2**31, 1], None, already_written=False)
    assert out.num_tokens[1:] == [0, 0, 0] and [i for i, _ in out.failures] == [1, 2, 3]
    assert [type(e).__name__ for _, e in out.failures] == ["UnknownSequence", "OutOfBlocks", "InvalidRequest"]
    assert out.num_tokens[0] == 5 and not m._seqs["a"].hashing   # no ids: hashing stops
    # an already-written report that does not fit in the partial block fails alone, cheaply
    out = m.append_tokens(["c"], [2**31], None, already_written=True)
    assert [type(e).__name__ for _, e in out.failures] == ["InvalidRequest"]
    assert m.get_sequence("c").num_tokens == before["pools"][0]["sequences"][2]["num_tokens"]
    with pytest.raises(InvalidRequest):
        m.append_tokens(["b"], [1], [1, 2])                  # ids for all or none
    assert m.fsck() == []


def test_two_failed_steps_in_a_row_build_on_the_last_applied_step() -> None:
    """Step 1 fails, step 2 (based on 0) fails: the node still holds step 0's state, so step 3
    must say it builds on 0 — not on step 1, which never ran."""
    m = BlockManager()
    m.add_pool("p", 16, 2)
    for i, sid in enumerate(["a", "b", "c"]):
        m.allocate(sid, "p", [1, 2, 3])
        out = m.close_step("p")
        assert out is not None
        if i < 2:
            m.settle_steps("p", out.step_id - 1, failed_from=out.step_id)
    assert out.base_step_id == 0


def test_a_failure_after_a_completed_step_builds_on_that_step_and_survives_a_snapshot() -> None:
    """Step 1 fails; step 2 (based on 0) completes; step 3 fails: the node holds step 2, so step
    4 builds on 2. A snapshot taken with failed-over steps unsettled keeps each step's base."""
    m = BlockManager()
    m.add_pool("p", 16, 2)
    m.allocate("a", "p", [1, 2, 3])
    s1 = m.close_step("p")
    m.settle_steps("p", 0, failed_from=s1.step_id)
    m.allocate("b", "p", [4, 5, 6])
    s2 = m.close_step("p")
    assert s2.base_step_id == 0
    m.allocate("c", "p", [7, 8, 9])
    s3 = m.close_step("p")
    assert s3.base_step_id == s2.step_id
    restored = BlockManager.from_snapshot(m.to_snapshot())
    for mgr in (m, restored):
        mgr.settle_steps("p", s2.step_id, failed_from=s3.step_id)
        mgr.allocate("d", "p", [1, 1, 1])
        assert mgr.close_step("p").base_step_id == s2.step_id
        assert mgr.fsck() == []
