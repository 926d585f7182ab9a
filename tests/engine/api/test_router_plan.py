"""`Fleet.plan`, the router's decision, on Route answers written by hand: every known engine is
tried once, in the documented order, whatever the answer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager.client.types import PoolRoute
from engine.api.router_fleet import Fleet, RoutedBy, RoutePlan, normalize_url


def entry(pool: str, owner: str, cached: int = 0, running: int = 0, waiting: int = 0) -> PoolRoute:
    return PoolRoute(pool, cached, 10, "127.0.0.1:9", scheduler_id=owner, scheduler_address=owner and f"http://{owner}:8000",
                     scheduler_num_running=running, scheduler_num_waiting=waiting)


def test_the_prefix_owner_first_then_by_load() -> None:
    fleet = Fleet()
    plan = fleet.plan([entry("n2", "b", cached=32, running=5), entry("n1", "a", running=1), entry("n3", "c")])
    assert plan.urls == ("http://b:8000", "http://c:8000", "http://a:8000")
    assert (plan.routed_by, plan.num_cached_tokens) == (RoutedBy.PREFIX, 32)
    plan = fleet.plan([entry("n1", "a", running=1), entry("n2", "b", running=5), entry("n3", "c", running=3)])
    assert plan.urls == ("http://a:8000", "http://c:8000", "http://b:8000") and plan.routed_by is RoutedBy.LOAD


def test_an_unowned_pool_or_one_without_address_is_skipped() -> None:
    fleet = Fleet(["10.0.0.9:8000"])
    plan = fleet.plan([entry("n1", "", cached=64)])            # no member: the static engines
    assert plan == RoutePlan(("http://10.0.0.9:8000",), RoutedBy.STATIC)
    plan = fleet.plan([entry("n1", "", cached=64), entry("n2", "a")])
    assert plan.urls == ("http://a:8000",) and plan.routed_by is RoutedBy.LOAD


def test_a_full_view_forgets_members_that_own_nothing() -> None:
    fleet = Fleet()
    fleet.replace([entry("n1", "a"), entry("n2", "b")])
    fleet.observe([entry("n1", "a")])                           # a per-request answer forgets nobody
    assert set(fleet.members) == {"http://a:8000", "http://b:8000"}
    fleet.replace([entry("n1", "a"), entry("n2", "a")])        # b's pool went to a
    assert set(fleet.members) == {"http://a:8000"}


def test_a_failed_owner_is_tried_last() -> None:
    fleet = Fleet()
    entries = [entry("n1", "a", cached=16), entry("n2", "b", running=3)]
    assert fleet.plan(entries).urls[0] == "http://a:8000"
    fleet.failed("http://a:8000")
    plan = fleet.plan(entries)
    assert plan.urls == ("http://b:8000", "http://a:8000") and plan.routed_by is RoutedBy.LOAD


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", ""]), st.integers(0, 64), st.integers(0, 40)),
                min_size=1, max_size=6),
       st.integers(0, 20))
def test_every_member_is_tried_exactly_once(pools: list[tuple[str, int, int]], max_imbalance: int) -> None:
    fleet = Fleet(max_imbalance=max_imbalance)
    entries = [entry(f"n{i}", owner, cached, running) for i, (owner, cached, running) in enumerate(pools)]
    plan = fleet.plan(entries)
    owners = {normalize_url(f"{o}:8000") for o, _, _ in pools if o}
    assert sorted(plan.urls) == sorted(owners)
    if not owners:
        assert plan.routed_by is RoutedBy.STATIC and plan.urls == ()
        return
    loads = {u: fleet.members[u].load for u in plan.urls}
    if plan.routed_by is RoutedBy.PREFIX:
        best = max((e for e in entries if e.scheduler_address), key=lambda e: e.num_cached_tokens)
        assert plan.urls[0] == normalize_url(best.scheduler_address) and plan.num_cached_tokens > 0
        assert loads[plan.urls[0]] <= min(loads.values()) + max_imbalance
        rest = plan.urls[1:]
    else:
        rest = plan.urls
    assert [loads[u] for u in rest] == sorted(loads[u] for u in rest)
