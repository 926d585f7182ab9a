"""Fleet mode over real gRPC (issue 46): several schedulers over one block manager, each pool
owned by exactly one live member (docs/block_manager_service.md, "Fleet mode").

Heartbeat -> ownership and balance, the release handshake, lapse -> reassignment within one
TTL, a member's Step refused on a pool it does not own, prefix fetch across owners (the source
owner's steps untouched), ownership kept across a restart (SQLite), ListSchedulers and the CLI.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from block_manager.cli import admin as admin_cli
from block_manager.client import (
    AdminClient,
    AsyncBlockManagerClient,
    FailedPreconditionError,
    FleetAssignment,
    RetryPolicy,
    StepResult,
)
from block_manager.client.types import Admission
from block_manager.service.access import authorize
from pagedkv.auth import Principal
from pagedkv.v1 import block_manager_pb2 as pb

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
TTL = 2.0
PROMPT = list(range(1, 41))   # 10 blocks of 4


def client(h: Any, sid: str) -> AsyncBlockManagerClient:
    return AsyncBlockManagerClient(f"127.0.0.1:{h.server.port}", scheduler_id=sid, retry=FAST_RETRY)


def forwarded(c: AsyncBlockManagerClient, result: StepResult) -> StepResult:
    """Every PoolStep's Forward ran: reported with the client's next step."""
    for ps in result.steps.values():
        c.report(ps, ok=True)
    return result


async def register(h: Any, *nodes: str, num_blocks: int = 64) -> None:
    for n in nodes:
        await h.register(n, num_blocks=num_blocks)


def owned(a: FleetAssignment) -> set[str]:
    return {p.pool_id for p in a.pools}


async def settle(*members: tuple[AsyncBlockManagerClient, str]) -> dict[str, FleetAssignment]:
    """Heartbeat every member, honouring release requests, until nothing is asked."""
    last: dict[str, FleetAssignment] = {}
    asked: dict[str, tuple[str, ...]] = {}
    for _ in range(10):
        for c, address in members:
            last[c.scheduler_id] = await c.scheduler_heartbeat(
                address=address, released_pool_ids=asked.get(c.scheduler_id, ()))
            asked[c.scheduler_id] = last[c.scheduler_id].release_pool_ids
        if not any(asked.values()):
            return last
    raise AssertionError(f"no settled assignment: {last}")


async def test_heartbeat_assigns_every_pool_once_and_balances(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2", "n3")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    first = await a.scheduler_heartbeat(address="http://a:8000", num_running=3, num_waiting=1)
    assert owned(first) == {"n1", "n2", "n3"} and first.ttl_s == 30.0   # the only member owns all
    assert all(p.address == "127.0.0.1:1" and p.lease_epoch == 1 for p in first.pools)
    joined = await b.scheduler_heartbeat(address="http://b:8000")
    assert owned(joined) == set()   # nothing free: b waits for a release
    asked = await a.scheduler_heartbeat(address="http://a:8000")
    assert len(asked.release_pool_ids) == 1   # a owns 3, b 0: one release asked (one at a time)
    moving = asked.release_pool_ids[0]
    still = await a.scheduler_heartbeat(address="http://a:8000")
    assert moving in owned(still) and still.release_pool_ids == (moving,)   # until a reports it
    after = await a.scheduler_heartbeat(address="http://a:8000", released_pool_ids=[moving])
    assert moving not in owned(after) and after.release_pool_ids == ()
    got = await b.scheduler_heartbeat(address="http://b:8000")
    assert owned(got) == {moving} and got.pools[0].lease_epoch == 2   # a new lease epoch
    assert owned(after) | owned(got) == {"n1", "n2", "n3"} and not owned(after) & owned(got)
    text = (await asyncio.to_thread(h.server.metrics.render)).decode()
    assert "pagedkv_fleet_members 2.0" in text
    assert 'pagedkv_fleet_owned_pools{scheduler="sched-a"} 2.0' in text
    assert 'pagedkv_fleet_owned_pools{scheduler="sched-b"} 1.0' in text
    # a new node goes to the least loaded member at once (a round follows the registration)
    await register(h, "n4")
    assert owned(await b.scheduler_heartbeat(address="http://b:8000")) == {moving, "n4"}
    # Route names each pool's owner, its API address and load
    routes = {r.pool_id: r for r in await a.route(PROMPT[:8])}
    assert routes["n4"].scheduler_id == "sched-b" and routes["n4"].scheduler_address == "http://b:8000"
    kept = sorted(owned(after))[0]
    assert routes[kept].scheduler_id == "sched-a"
    assert (routes[kept].scheduler_num_running, routes[kept].scheduler_num_waiting) == (0, 0)   # as last said
    await a.scheduler_heartbeat(address="http://a:8000", num_running=5, num_waiting=2)
    routes = {r.pool_id: r for r in await a.route(PROMPT[:8])}
    assert (routes[kept].scheduler_num_running, routes[kept].scheduler_num_waiting) == (5, 2)
    await a.close()
    await b.close()
    assert await h.fsck() == []


async def test_pins_are_respected(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2", "n3")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    assert owned(await a.scheduler_heartbeat(pin_pool_ids=["n1"])) == {"n1"}
    assert owned(await b.scheduler_heartbeat(pin_pool_ids=["n2", "n3"])) == {"n2", "n3"}
    res = await settle((a, ""), (b, ""))
    assert owned(res["sched-a"]) == {"n1"}   # 1 vs 2, but b's pools are not a's to take
    await a.close()
    await b.close()


async def test_release_handshake_moves_a_pool_with_its_sequences_freed(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat()
    step = a.step()
    step.allocate("s1", "n1", PROMPT[:8])
    step.allocate("s2", "n2", PROMPT[:8])
    forwarded(a, await step.commit())
    await b.scheduler_heartbeat()
    asked = (await a.scheduler_heartbeat()).release_pool_ids
    assert len(asked) == 1
    pool = asked[0]
    seq = "s1" if pool == "n1" else "s2"
    # the member frees its sequences there, then reports the pool released
    assert await a.free([seq]) == 1
    after = await a.scheduler_heartbeat(released_pool_ids=[pool])
    assert pool not in owned(after)
    assert owned(await b.scheduler_heartbeat()) == {pool}
    # its Steps on the pool it gave away are refused (PoolLeased -> FAILED_PRECONDITION)
    step = a.step()
    step.allocate("s3", pool, PROMPT[:8])
    with pytest.raises(FailedPreconditionError, match="driven by scheduler 'sched-b'"):
        await step.commit()
    # b drives it
    step = b.step()
    step.allocate("s4", pool, PROMPT[:8])
    res = forwarded(b, await step.commit())
    assert isinstance(res.allocations["s4"], Admission)
    await a.close()
    await b.close()
    assert await h.fsck() == []


async def test_member_step_is_refused_on_a_pool_it_does_not_own(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat(pin_pool_ids=["n1"])
    await b.scheduler_heartbeat(pin_pool_ids=["n2"])
    step = a.step()
    step.allocate("x", "n2", PROMPT[:8])
    with pytest.raises(FailedPreconditionError, match="driven by scheduler 'sched-b'") as err:
        await step.commit()
    assert err.value.code.name == "FAILED_PRECONDITION"   # PoolLeased, the whole Step refused
    # even a pool nobody owns: a member never takes one by stepping on it
    await register(h, "n3")
    await asyncio.sleep(0.2)   # the round after the registration: n3 fits nobody's pins
    step = a.step()
    step.allocate("y", "n3", PROMPT[:8])
    with pytest.raises(FailedPreconditionError, match="not owned by fleet member"):
        await step.commit()
    # a non-member keeps today's behaviour: it takes the free pool by stepping on it
    x = client(h, "not-a-member")
    step = x.step()
    step.allocate("z", "n3", PROMPT[:8])
    res = forwarded(x, await step.commit())
    assert isinstance(res.allocations["z"], Admission) and res.lease_epochs["n3"] == 1
    # placement offers a member only its own pools
    step = a.step()
    for i in range(3):
        step.allocate(f"p{i}", None, [100 + i] * 8)
    res = await step.commit()
    assert {adm.pool_id for adm in res.allocations.values() if isinstance(adm, Admission)} == {"n1"}
    for c in (a, b, x):
        await c.close()


async def test_lapsed_member_pools_go_to_the_others_within_one_ttl(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=TTL)
    await register(h, "n1", "n2", "n3", "n4")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat()
    await b.scheduler_heartbeat()
    res = await settle((a, ""), (b, ""))
    mine = sorted(owned(res["sched-a"]))
    assert len(mine) == 2 and len(owned(res["sched-b"])) == 2
    step = a.step()
    step.allocate("a-seq", mine[0], PROMPT[:8])
    forwarded(a, await step.commit())
    # a stops heartbeating; b goes on every ttl/3
    lapsed_at = time.monotonic()
    taken_after = None
    while time.monotonic() - lapsed_at < TTL + 1.5:
        got = await b.scheduler_heartbeat()
        if owned(got) == {"n1", "n2", "n3", "n4"}:
            taken_after = time.monotonic() - lapsed_at
            break
        await asyncio.sleep(TTL / 3)
    assert taken_after is not None and taken_after <= TTL + TTL / 3 + 0.5, taken_after
    # a's sequence there was dropped with the handover; a is no member any more
    admin = h.admin
    assert [s.scheduler_id for s in (await admin.ListSchedulers(pb.ListSchedulersRequest())).schedulers] == ["sched-b"]
    listed = await admin.ListSequences(pb.ListSequencesRequest())
    assert "a-seq" not in {s.seq_id for s in listed.sequences}
    await a.close()
    await b.close()
    assert await h.fsck() == []


async def test_leave_hands_every_pool_to_the_others(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat()
    await b.scheduler_heartbeat()
    left = await a.scheduler_heartbeat(leave=True)
    assert left.pools == ()
    assert owned(await b.scheduler_heartbeat()) == {"n1", "n2"}
    await a.close()
    await b.close()


async def test_prefix_fetch_across_owners_is_read_only_for_the_source(start_server: Callable[..., Any]) -> None:
    """b admits a prompt whose prefix is cached on a's pool: it is placed on b's own pool with
    the prefix fetched; b's Step does not close a's pool's step (the grant waits there for a's
    next Step, which delivers it), and a's own sequences and steps go on as before."""
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    assert owned(await a.scheduler_heartbeat(pin_pool_ids=["n1"])) == {"n1"}
    assert owned(await b.scheduler_heartbeat(pin_pool_ids=["n2"])) == {"n2"}
    step = a.step()
    step.allocate("a1", None, PROMPT)
    res = forwarded(a, await step.commit())
    assert res.allocations["a1"].pool_id == "n1"   # type: ignore[union-attr]
    step = a.step()
    step.append("a1", [99])
    res = forwarded(a, await step.commit())   # the prompt's step reported: its blocks are hits now
    a_step_before = res.steps["n1"].step_id if "n1" in res.steps else None
    step = b.step()
    step.allocate("b1", None, PROMPT)
    res = forwarded(b, await step.commit())
    adm = res.allocations["b1"]
    assert isinstance(adm, Admission) and adm.pool_id == "n2"
    assert adm.num_cached_tokens >= 32   # fetched from a's n1, not recomputed
    assert set(res.steps) == {"n2"}   # a's pool's step is not b's to close
    fetches = res.steps["n2"].message.fetches
    assert len(fetches) == 1 and fetches[0].src_pool_id == "n1"
    # a is told its pool lends, and any Step of a delivers the grant with n1's step
    beat = await a.scheduler_heartbeat(pin_pool_ids=["n1"])
    assert beat.lending_pool_ids == ("n1",)
    step = a.step()
    step.append("a1", [98])
    res = forwarded(a, await step.commit())
    serves = res.steps["n1"].message.serves
    assert len(serves) == 1 and serves[0].dst_pool_id == "n2" and serves[0].fetch_id == fetches[0].fetch_id
    assert a_step_before is None or res.steps["n1"].step_id > a_step_before
    assert res.appends["a1"].context_len == len(PROMPT) + 2   # type: ignore[union-attr]
    assert (await a.scheduler_heartbeat(pin_pool_ids=["n1"])).lending_pool_ids == ()
    # b's report ends the loan; both go on
    await b.flush_reports()
    step = b.step()
    step.append("b1", [7])
    forwarded(b, await step.commit())
    assert await h.fsck() == []
    await a.close()
    await b.close()


async def test_an_idle_owner_delivers_a_grant_with_deliver_grants(start_server: Callable[..., Any]) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat(pin_pool_ids=["n1"])
    await b.scheduler_heartbeat(pin_pool_ids=["n2"])
    step = a.step()
    step.allocate("a1", None, PROMPT)
    forwarded(a, await step.commit())
    await a.free(["a1"])   # a is idle now; its prefix stays cached on n1
    await a.flush_reports()
    step = b.step()
    step.allocate("b1", None, PROMPT)
    res = forwarded(b, await step.commit())
    assert res.allocations["b1"].num_cached_tokens >= 32   # type: ignore[union-attr]
    assert (await a.scheduler_heartbeat(pin_pool_ids=["n1"])).lending_pool_ids == ("n1",)
    res = forwarded(a, await a.deliver_grants())
    assert len(res.steps["n1"].message.serves) == 1
    await a.flush_reports()
    await b.flush_reports()
    assert await h.fsck() == []
    await a.close()
    await b.close()


async def test_ownership_survives_a_restart(start_server: Callable[..., Any], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bm.db'}"
    h = await start_server(scheduler_lease_ttl_s=30.0, database_url=url)
    await register(h, "n1", "n2", "n3", "n4")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat()
    await b.scheduler_heartbeat()
    before = await settle((a, ""), (b, ""))
    await a.close()
    await b.close()
    await h.channel.close()
    await h.server.stop(0)
    h2 = await start_server(scheduler_lease_ttl_s=30.0, database_url=url)
    a, b, c = client(h2, "sched-a"), client(h2, "sched-b"), client(h2, "sched-c")
    # a newcomer gets nothing: every pool is still leased to its owner (who has not yet come back)
    assert owned(await c.scheduler_heartbeat()) == set()
    for sid, cl in (("sched-a", a), ("sched-b", b)):
        again = await cl.scheduler_heartbeat()
        assert again.pools == before[sid].pools   # same pools, same lease epochs
    await c.scheduler_heartbeat(leave=True)
    for cl in (a, b, c):
        await cl.close()


async def test_list_schedulers_and_the_cli(
    start_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    h = await start_server(scheduler_lease_ttl_s=30.0)
    await register(h, "n1", "n2")
    a = client(h, "sched-a")
    await a.scheduler_heartbeat(address="http://a:8000", pin_pool_ids=["n1", "n2"], num_running=4, num_waiting=1)
    target = f"127.0.0.1:{h.server.port}"

    def listing() -> Any:
        with AdminClient(target) as admin:
            return admin.list_schedulers()

    (s,) = await asyncio.to_thread(listing)
    assert (s.scheduler_id, s.address, s.pool_ids, s.release_pool_ids, s.pin_pool_ids) == (
        "sched-a", "http://a:8000", ("n1", "n2"), (), ("n1", "n2"))
    assert (s.num_running, s.num_waiting) == (4, 1) and 29.0 < s.remaining_s <= 30.0
    assert await asyncio.to_thread(admin_cli.main, ["schedulers", "--target", target, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedulers"][0]["scheduler_id"] == "sched-a" and out["schedulers"][0]["pool_ids"] == ["n1", "n2"]
    assert await asyncio.to_thread(admin_cli.main, ["schedulers", "--target", target]) == 0
    text = capsys.readouterr().out
    assert "sched-a" in text and "http://a:8000" in text and "n1 n2" in text
    await a.close()


def test_only_the_named_scheduler_may_heartbeat_as_itself() -> None:
    method = "/pagedkv.v1.BlockManager/SchedulerHeartbeat"
    req = pb.SchedulerHeartbeatRequest(scheduler_id="sched-a")
    assert authorize(method, Principal("scheduler", "sched-a"), req) is None
    assert authorize(method, Principal("scheduler", ""), req) is None
    assert authorize(method, Principal("scheduler", "sched-b"), req) is not None
    assert authorize(method, Principal("node", "sched-a"), req) is not None


async def test_after_a_restart_the_pools_of_a_member_that_never_returns_go_to_the_others(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'bm.db'}"
    h = await start_server(scheduler_lease_ttl_s=TTL, database_url=url)
    await register(h, "n1", "n2")
    a, b = client(h, "sched-a"), client(h, "sched-b")
    await a.scheduler_heartbeat()
    await b.scheduler_heartbeat()
    before = await settle((a, ""), (b, ""))
    assert len(owned(before["sched-a"])) == 1
    await a.close()
    await b.close()
    await h.channel.close()
    await h.server.stop(0)
    h2 = await start_server(scheduler_lease_ttl_s=TTL, database_url=url)
    b = client(h2, "sched-b")
    assert owned(await b.scheduler_heartbeat()) == owned(before["sched-b"])   # a's lease still lives
    t0 = time.monotonic()
    while owned(await b.scheduler_heartbeat()) != {"n1", "n2"}:
        assert time.monotonic() - t0 < TTL + 1.5, "a's lapsed lease was not reassigned"
        await asyncio.sleep(TTL / 4)
    await b.close()
    assert await h2.fsck() == []
