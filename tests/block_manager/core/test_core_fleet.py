"""Fleet mode's membership and assignment rules (`block_manager/core/fleet.py`), case by case.
The random sequences are in tests/block_manager/service/test_fleet_property.py."""

from __future__ import annotations

import pytest

from block_manager.core.errors import InvalidRequest
from block_manager.core.fleet import Fleet, PoolView


def pool(pid: str, holder: str | None = None, *, blocks: int = 16, assignable: bool = True, epoch: int = 1,
         lapsed: bool = False) -> PoolView:
    return PoolView(pid, blocks, assignable, holder, epoch if holder else 0, lapsed)


def fleet(*members: str | tuple[str, tuple[str, ...]], now: float = 0.0) -> Fleet:
    f = Fleet(10.0)
    for m in members:
        sid, pins = (m, ()) if isinstance(m, str) else m
        f.heartbeat(sid, now, pin_pool_ids=pins)
    return f


def test_a_free_pool_goes_to_the_member_with_fewest_pools_then_blocks_then_id() -> None:
    f = fleet("b", "a", "c")
    plan = f.plan([pool("p1", "a", blocks=8), pool("p2", "b", blocks=32), pool("p3"), pool("p4")])
    # c owns none: it gets p3; then a (1 pool, 8 blocks) beats b (1 pool, 32 blocks) for p4
    assert plan.grants == [("p3", "c"), ("p4", "a")]
    assert plan.releases == [] and plan.asks == []


def test_pools_that_admit_nothing_or_fit_no_pins_stay_free() -> None:
    f = fleet(("a", ("p1",)))
    plan = f.plan([pool("p1", assignable=False), pool("p2")])
    assert plan.grants == []


def test_a_leaving_member_releases_everything_and_takes_nothing() -> None:
    f = fleet("a", "b")
    plan = f.plan([pool("p1", "a", epoch=3), pool("p2", "a", epoch=1), pool("p3", "b")], leaving={"a"})
    assert plan.releases == [("p1", "a", 3), ("p2", "a", 1)]
    assert plan.grants == [("p1", "b"), ("p2", "b")]


def test_a_lapsed_lease_of_a_non_member_is_released_only_where_a_member_can_own_the_pool() -> None:
    f = fleet(("a", ("p1",)))
    views = [pool("p1", "gone", lapsed=True), pool("p2", "gone", lapsed=True), pool("p3", "other")]
    plan = f.plan(views)
    assert plan.releases == [("p1", "gone", 1)] and plan.grants == [("p1", "a")]   # p3's lease lives


def test_balance_asks_the_fullest_one_pool_at_a_time() -> None:
    f = fleet("a", "b")
    views = [pool(f"p{i}", "a") for i in range(4)]
    plan = f.plan(views)
    assert plan.asks == [("a", "p0")]
    f.ask(plan.asks)
    assert f.plan(views).asks == []   # one request pending per member
    # the release comes back: the pool goes to b, not back to a
    plan = f.plan(views, released={"a": {"p0"}})
    assert plan.releases == [("p0", "a", 1)] and plan.grants == [("p0", "b")]
    f.released("a", {"p0"})
    assert f.get("a").release_pool_ids == set()   # type: ignore[union-attr]


def test_balance_is_within_one_and_respects_pins() -> None:
    f = fleet("a", "b", "c")
    assert f.plan([pool("p1", "a"), pool("p2", "b")]).asks == []   # 1/1/0: within one
    assert f.plan([pool("p1", "a"), pool("p2", "a"), pool("p3", "b")]).asks == [("a", "p1")]   # 2/1/0 -> 1/1/1
    f = fleet("a", ("b", ("p9",)))
    assert f.plan([pool("p1", "a"), pool("p2", "a"), pool("p3", "a")]).asks == []   # b may own none of them


def test_a_pool_outside_its_holders_pins_is_asked_back() -> None:
    f = fleet(("a", ("p1",)), "b")
    plan = f.plan([pool("p1", "a"), pool("p2", "a")])
    assert plan.asks == [("a", "p2")]


def test_a_request_no_other_member_could_answer_is_dropped() -> None:
    f = fleet("a", "b")
    views = [pool("p1", "a"), pool("p2", "a")]
    f.ask(f.plan(views).asks)
    assert f.get("a").release_pool_ids == {"p1"}   # type: ignore[union-attr]
    f.remove("b")
    f.forget_requests(views)
    assert f.get("a").release_pool_ids == set()   # type: ignore[union-attr]


def test_membership_deadlines_and_checks() -> None:
    f = Fleet(10.0)
    f.heartbeat("a", 0.0, address="http://a:8000", num_running=2)
    f.heartbeat("b", 5.0)
    assert f.next_deadline() == 10.0 and f.expired(10.0) == ["a"] and f.remaining_s("b", 6.0) == 9.0
    f.heartbeat("a", 9.0)
    assert f.expired(10.0) == [] and f.get("a").address == ""   # type: ignore[union-attr]  # each beat says it
    with pytest.raises(InvalidRequest):
        f.heartbeat("c", 0.0, address="x" * 300)
    assert not f.is_member("c")   # a refused heartbeat changed nothing
    with pytest.raises(InvalidRequest):
        f.heartbeat("", 0.0)
    with pytest.raises(InvalidRequest):
        Fleet(0)
