"""The host tier's rules one by one (the state machine in test_core_tiers_stateful.py mixes
them): a failed step voids the swap-outs and offloads it carried, a swap-in waits for its
swap-out's report, host sources are held until the step that reads them is reported, salted
prefixes stay isolated on host, a pool handed to a new scheduler drops its swapped sequences,
and a pool without a host tier refuses swaps with a clear error."""

from __future__ import annotations

import pytest

from block_manager.core import BlockManager, FailedPrecondition, OutOfBlocks, PendingWrite
from tests.block_manager.core.one_pool import BS, one_pool, run_step


def _manager(num_blocks: int = 8, host: int = 8) -> BlockManager:
    return one_pool(num_blocks, host)


_run = run_step


def test_a_failed_step_drops_the_swapped_out_sequences_it_carried() -> None:
    m = _manager()
    m.allocate("a", "p", list(range(1, 10)))
    _run(m)
    m.swap_out(["a"])
    out = m.close_step("p")
    assert [op.kind for op in out.tier_ops] == ["swap_out"] * 3 and out.dropped_seq_ids == ("a",)
    res = m.settle_steps("p", out.step_id - 1, failed_from=out.step_id)
    assert res.dropped_seq_ids == ("a",)            # its K/V never reached host: recompute it
    assert not m.has_sequence("a") and m.host_metrics("p").num_used_blocks == 0
    assert m.fsck() == []


def test_a_failed_step_forgets_the_prefix_blocks_it_offloaded() -> None:
    m = _manager(num_blocks=4)
    m.allocate("a", "p", list(range(1, 10)))       # 2 full hashed blocks + 1
    _run(m)
    m.free(["a"])
    m.evict("p", 2)                                  # offloaded to host in the open step
    out = m.close_step("p", force=True)
    assert [op.kind for op in out.tier_ops] == ["offload", "offload"]
    host = m.host_metrics("p")
    assert host.num_used_blocks == 2 and host.num_cached_blocks == 0   # held by the step writing them
    m.settle_steps("p", out.step_id - 1, failed_from=out.step_id)
    host = m.host_metrics("p")
    assert host.num_cached_blocks == 0 and host.num_used_blocks == 0   # never written: no host hit may read them
    r = m.allocate("b", "p", list(range(1, 10)))
    assert r.num_cached_tokens == 0 and m.fsck() == []


def test_an_offloaded_block_is_held_until_written_so_one_step_never_writes_a_host_block_twice() -> None:
    """One step evicting more blocks than the host tier has: the host blocks it is writing are
    not evicted again and reused by the same step (a batched copy with two writes to one
    block has no defined winner on CUDA); they join the LRU once the step is reported."""
    m = _manager(num_blocks=8, host=2)
    m.allocate("a", "p", list(range(1, 26)))         # 6 full hashed blocks + 1
    _run(m)
    m.free(["a"])
    m.evict("p", 6)
    out = m.close_step("p", force=True)
    targets = [op.dst for op in out.tier_ops if op.kind == "offload"]
    assert len(targets) == 2 and len(set(targets)) == 2
    assert m.host_metrics("p").num_cached_blocks == 0 and m.fsck() == []
    m.settle_steps("p", out.step_id)
    host = m.host_metrics("p")
    assert host.num_cached_blocks == 2 and host.host_evictions == 0 and m.fsck() == []
    r = m.allocate("b", "p", list(range(1, 26)))
    assert r.num_cached_tokens == 0          # the first blocks were not kept: no prefix to continue
    assert m.fsck() == []


def test_swap_in_waits_for_its_swap_out_report_and_holds_host_sources() -> None:
    m = _manager()
    m.allocate("a", "p", list(range(1, 8)))
    _run(m)
    m.swap_out(["a"])
    with pytest.raises(PendingWrite):
        m.swap_in(["a"])                             # the swap-out's step is not even closed
    out = m.close_step("p")
    with pytest.raises(PendingWrite):
        m.swap_in(["a"])                             # closed, not reported
    m.settle_steps("p", out.step_id)
    (view,) = m.swap_in(["a"])
    assert view.num_tokens == 7 and len(view.block_table) == 2
    host = m.host_metrics("p")
    assert host.num_used_blocks == 2 and host.num_swapped_sequences == 0   # held by the step reading them
    step = m.close_step("p")
    assert [op.kind for op in step.tier_ops] == ["swap_in", "swap_in"]
    assert [(d.seq_id, d.base_version, d.num_tokens) for d in step.deltas] == [("a", 0, 7)]
    m.settle_steps("p", step.step_id)
    assert m.host_metrics("p").num_used_blocks == 0 and m.fsck() == []


def test_forks_swapped_out_together_share_host_blocks() -> None:
    m = _manager(num_blocks=12, host=12)
    m.allocate("a", "p", list(range(1, 10)))
    _run(m)
    m.fork("a", ["b", "c"])
    m.swap_out(["a", "b", "c"])
    out = m.close_step("p", force=True)
    assert len(out.tier_ops) == 3                    # 3 shared blocks, once
    assert m.host_metrics("p").num_used_blocks == 3 and m.metrics("p").num_used_blocks == 0
    m.settle_steps("p", out.step_id)
    m.swap_in(["a", "b", "c"])
    views = {v.seq_id: v.block_table for v in m.sequences("p")}
    assert views["a"] == views["b"] == views["c"]   # shared again on device
    assert m.fsck() == []


def test_salted_prefixes_stay_isolated_on_host() -> None:
    m = _manager(num_blocks=4, host=8)
    tokens = list(range(1, 10))
    m.allocate("a", "p", tokens, salt="tenant-a")
    _run(m)
    m.free(["a"])
    m.evict("p", 2)
    m.settle_steps("p", m.close_step("p", force=True).step_id)
    assert m.host_metrics("p").num_cached_blocks == 2
    for sid, salt in (("x", "tenant-b"), ("y", None)):     # other tenants miss on host too
        assert m.allocate(sid, "p", tokens, salt=salt).num_cached_tokens == 0
        _run(m)
        m.free([sid])
    assert m.host_metrics("p").onboarded_blocks == 0
    assert m.allocate("z", "p", tokens, salt="tenant-a").num_cached_tokens == 8   # its own tenant hits
    assert m.host_metrics("p").onboarded_blocks == 2 and m.fsck() == []


def test_onboarding_a_host_hit_counts_as_cached() -> None:
    m = _manager(num_blocks=4, host=8)
    tokens = list(range(1, 10))
    m.allocate("a", "p", tokens)
    _run(m)
    m.free(["a"])
    m.evict("p", 2)
    m.settle_steps("p", m.close_step("p", force=True).step_id)
    r = m.allocate("b", "p", tokens)
    assert r.num_cached_tokens == 8 and r.slot_mapping == tuple(r.block_table[2] * BS + i for i in range(1))
    out = m.close_step("p")
    assert [op.kind for op in out.tier_ops] == ["onboard", "onboard"]
    assert [op.dst for op in out.tier_ops] == list(r.block_table[:2])
    h = m.host_metrics("p")
    assert h.host_hit_tokens == 8 and h.onboarded_blocks == 2 and m.metrics("p").prefix_hit_tokens == 0
    assert m.fsck() == []


def test_a_full_host_tier_or_none_refuses_swaps_unchanged() -> None:
    m = _manager(num_blocks=8, host=1)
    m.allocate("a", "p", list(range(1, 8)))
    _run(m)
    before = m.to_snapshot()
    with pytest.raises(OutOfBlocks, match="host tier full"):
        m.swap_out(["a"])
    assert m.to_snapshot() == before
    m.add_pool("q", 8, BS)
    m.allocate("c", "q", [1, 2, 3])
    m.settle_steps("q", m.close_step("q").step_id)
    with pytest.raises(FailedPrecondition, match="no host tier"):
        m.swap_out(["c"])


def test_a_pool_handed_over_drops_its_swapped_sequences() -> None:
    m = _manager()
    m.allocate("a", "p", list(range(1, 8)))
    _run(m)
    m.swap_out(["a"])
    _run(m)
    assert m.is_swapped("a")
    assert "a" in m.abandon_pool("p")
    assert not m.has_sequence("a") and m.host_metrics("p").num_used_blocks == 0 and m.fsck() == []
