"""Prefix fetch between pools, the core's ledger (block_manager/core/fetch.py): a fetch is
planned where the destination's own prefix ends, the source blocks are pinned until the
destination's step is reported (done or failed), the fetched blocks become hits only once that
step is reported complete, a failure forgets them, nothing leaks (fsck after every move), and
route's answer splits each candidate's prompt into local, fetchable and missing tokens."""

from __future__ import annotations

from block_manager.core import BlockManager
from block_manager.core.fetch import FETCH_SPEEDUP, MIN_FETCH_BLOCKS, score

BS = 4
PROMPT = list(range(1, 4 * BS + 3))   # 4 full blocks + 2 tokens


def _manager(num_blocks: int = 16) -> BlockManager:
    m = BlockManager(watermark=0.0)
    m.add_pool("a", num_blocks, BS)
    m.add_pool("b", num_blocks, BS)
    return m


def _run(m: BlockManager, pool: str, ok: bool = True) -> int:
    out = m.close_step(pool, force=True)
    assert out is not None
    if ok:
        m.settle_steps(pool, out.step_id)
    else:
        m.settle_steps(pool, out.step_id - 1, failed_from=out.step_id)
    return out.step_id


def _cached_on_a(m: BlockManager) -> None:
    m.allocate("s0", "a", PROMPT)
    _run(m, "a")
    m.free(["s0"])


def test_a_fetch_is_planned_where_the_local_prefix_ends_and_pins_its_sources() -> None:
    m = _manager()
    _cached_on_a(m)
    r = m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    assert r.num_cached_tokens == 4 * BS            # fetched tokens count as cached
    out_b = m.close_step("b")
    (op,) = out_b.fetches
    assert op.src_pool == "a" and op.first_token == 0 and len(op.src_blocks) == 4
    assert op.dst_blocks == tuple(r.block_table[:4]) and op.token_ids == tuple(PROMPT[: 4 * BS])
    # the source is told to serve exactly those blocks, in its own step
    out_a = m.close_step("a")
    (grant,) = out_a.serves
    assert grant.fetch_id == op.fetch_id and grant.blocks == op.src_blocks and grant.dst_pool == "b"
    a = m._pools["a"]
    assert all(a.ref_cnt[blk] == 1 for blk in op.src_blocks)   # pinned: not evictable
    assert m.free_blocks("a")[1] == 16 - 4
    assert m.fsck() == []
    # not yet a hit on b: the pull has not been reported
    assert m.route(PROMPT, fetch_sources=[])[0].pool_id == "a"
    m.settle_steps("a", out_a.step_id)
    m.settle_steps("b", out_b.step_id)              # the scheduler's report commits b's blocks
    assert all(a.ref_cnt[blk] == 0 for blk in op.src_blocks) and a.lent == {}
    assert m.fsck() == []
    m.free(["s1"])
    r2 = m.allocate("s2", "b", PROMPT)             # now a local hit on b
    assert r2.num_cached_tokens == 4 * BS
    assert m._pools["b"].fetched_blocks == 4 and m.fsck() == []


def test_a_failed_destination_step_unpins_and_forgets_the_fetched_blocks() -> None:
    m = _manager()
    _cached_on_a(m)
    m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    _run(m, "a")
    _run(m, "b", ok=False)                          # the node died mid-pull: the step failed
    assert not m.has_sequence("s1")                 # dropped: the scheduler recomputes it
    assert m._pools["a"].lent == {} and m.fsck() == []
    r = m.allocate("s2", "b", PROMPT)               # nothing of the failed fetch is a hit
    assert r.num_cached_tokens == 0
    assert m.fsck() == []


def test_no_fetch_below_the_minimum_nor_from_itself_nor_while_unwritten() -> None:
    m = _manager()
    m.allocate("s0", "a", PROMPT)
    # a's blocks are not written yet (its step is not reported): nothing to fetch
    r = m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    assert r.num_cached_tokens == 0 and m.close_step("b").fetches == ()
    _run(m, "a")
    m.free(["s0"])
    short = PROMPT[: MIN_FETCH_BLOCKS * BS]         # only MIN_FETCH_BLOCKS - 1 blocks are hits
    r = m.allocate("s2", "b", short, fetch_sources=["a", "b"])
    assert r.num_cached_tokens == 0
    r = m.allocate("s3", "a", PROMPT, fetch_sources=["a"])   # local hits, no fetch from itself
    assert r.num_cached_tokens == 4 * BS and m._pools["a"].lent == {}
    assert m.fsck() == []


def test_the_fetch_continues_a_partial_local_prefix() -> None:
    m = _manager()
    _cached_on_a(m)
    m.allocate("p1", "b", PROMPT[: BS + 1])         # b holds the first block only
    _run(m, "b")
    m.free(["p1"])
    r = m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    assert r.num_cached_tokens == 4 * BS
    (op,) = m.close_step("b").fetches
    assert op.first_token == BS and len(op.src_blocks) == 3
    assert op.token_ids == tuple(PROMPT[BS: 4 * BS])
    assert m.fsck() == []


def test_removing_or_abandoning_the_destination_ends_its_loans() -> None:
    for how in ("remove", "abandon"):
        m = _manager()
        _cached_on_a(m)
        m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
        m.close_step("b")
        assert m._pools["a"].lent
        if how == "remove":
            m.remove_pool("b")
        else:
            m.abandon_pool("b")
        assert m._pools["a"].lent == {} and m.fsck() == [], how


def test_removing_the_source_leaves_the_destination_consistent() -> None:
    m = _manager()
    _cached_on_a(m)
    m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    m.remove_pool("a")                                # the source node is fenced off mid-fetch
    out = m.close_step("b")
    assert len(out.fetches) == 1 and m.fsck() == []   # the node's pull fails: it recomputes
    m.settle_steps("b", out.step_id)
    assert m.fsck() == []


def test_a_lending_pool_takes_no_defrag_plan_and_snapshots_keep_loans() -> None:
    m = _manager()
    _cached_on_a(m)
    m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    assert m.plan_defrag("a", "compaction") is None
    snap = m.to_snapshot()
    m2 = BlockManager.from_snapshot(snap)
    assert m2.to_snapshot() == snap and m2.fsck() == []
    out = m2.close_step("b")
    assert len(out.fetches) == 1 and len(m2.close_step("a").serves) == 1
    m2.settle_steps("b", out.step_id)
    assert m2._pools["a"].lent == {} and m2.fsck() == []


def test_route_splits_local_fetchable_and_missing_per_candidate() -> None:
    m = _manager()
    m.add_pool("c", 16, BS)
    _cached_on_a(m)
    m.set_draining("a", True)                         # a serves as a source, not as a destination
    entries = {e.pool_id: e for e in m.route(PROMPT)}
    assert set(entries) == {"b", "c"}
    e = entries["b"]
    assert (e.num_cached_tokens, e.num_fetchable_tokens, e.num_missing_tokens) == (0, 4 * BS, 2)
    assert e.fetch_pool_id == "a"
    none = m.route(PROMPT, fetch_sources=[])[0]
    assert none.num_fetchable_tokens == 0 and none.num_missing_tokens == len(PROMPT)
    # the cost model: the longest local prefix beats fetching it; fetching beats recomputing
    assert score(100, 64, 0) < score(100, 0, 64) < score(100, 0, 0)
    assert score(100, 0, 64) == 36 + 64 / FETCH_SPEEDUP


def test_a_prefix_partly_in_the_sources_host_tier_is_fetched_from_both_tiers() -> None:
    """The source's device hits and the host-tier hits continuing them are lent together (the
    grant and the fetch op say which blocks are host blocks); host blocks are pinned (not
    evictable) until the destination reports, then back in the source's host LRU."""
    m = BlockManager(watermark=0.0)
    m.add_pool("a", 6, BS, host_num_blocks=8)
    m.add_pool("b", 16, BS)
    m.allocate("s0", "a", PROMPT)
    _run(m, "a")
    m.free(["s0"])
    m.evict("a", 4)                                   # every cached block of a's prefix to host
    _run(m, "a")                                      # the offloads are reported: host blocks written
    assert m.host_metrics("a").num_cached_blocks == 4
    r = m.allocate("s1", "b", PROMPT, fetch_sources=["a"])
    assert r.num_cached_tokens == 4 * BS
    (op,) = m.close_step("b").fetches
    (grant,) = m.close_step("a").serves
    assert op.src_host == (True,) * 4 and grant.host == (True,) * 4 and grant.blocks == op.src_blocks
    host = m._pools["a"].host
    assert all(host.ref_cnt[h] == 1 for h in op.src_blocks) and m.host_metrics("a").num_cached_blocks == 0
    assert m.fsck() == []
    snap = m.to_snapshot()
    assert BlockManager.from_snapshot(snap).to_snapshot() == snap
    m.settle_steps("a", m.open_step_id("a") - 1)
    m.settle_steps("b", m.open_step_id("b") - 1)
    assert all(host.ref_cnt[h] == 0 for h in op.src_blocks) and m.host_metrics("a").num_cached_blocks == 4
    assert m.fsck() == []
    e = next(e for e in m.route(PROMPT) if e.pool_id == "b")
    assert e.num_cached_tokens == 4 * BS               # committed on b now


def test_route_counts_the_sources_host_tier_as_fetchable() -> None:
    m = BlockManager(watermark=0.0)
    m.add_pool("a", 6, BS, host_num_blocks=8)
    m.add_pool("b", 16, BS)
    m.allocate("s0", "a", PROMPT)
    _run(m, "a")
    m.free(["s0"])
    m.evict("a", 4)
    _run(m, "a")
    e = next(e for e in m.route(PROMPT) if e.pool_id == "b")
    assert (e.num_fetchable_tokens, e.fetch_pool_id) == (4 * BS, "a")
