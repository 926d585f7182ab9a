"""Fleet mode, the engine's side (issue 46): engines that join the block manager's fleet drive
only the nodes it assigns them, hand a node over when asked, adopt the nodes of a member that
stopped heartbeating or left, and serve a prefix cached on another member's node by a fetch.

Real services over gRPC (`tests.engine.services`: the block manager and two model nodes
in-process), two `LLMEngine`s in this process, each with its own `BlockManagerClient` under its
own scheduler id; a short membership TTL so ownership moves in seconds. Greedy tokens are
compared with transformers'."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient, BlockManagerClient
from engine.executor import RemoteNode
from engine.fleet import FleetMember, FleetSettings
from engine.llm_engine import EngineConfig, LLMEngine
from engine.params import RequestOutput, SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy
from tests.engine.services import Services
from tests.support.polling import eventually_sync

MODEL = "llama-gqa4-hd64"
TTL_S = 2.0
BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def services(model_dirs: dict[str, Path]) -> Iterator[Services]:
    s = Services(model_dirs[MODEL], num_nodes=2, bm={"scheduler_lease_ttl_s": TTL_S})
    try:
        yield s
    finally:
        s.close()


class Members:
    """The engines a test starts (closed at its end, each at most once)."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.engines: list[LLMEngine] = []

    def start(self, name: str, *, pins: tuple[str, ...] = (), **config: Any) -> LLMEngine:
        client = BlockManagerClient(self.services.bm.address, scheduler_id=name)
        nodes = {n.config.node_id: RemoteNode(n.config.node_id, n.address) for n in self.services.nodes}
        member = FleetMember(client, FleetSettings(address=f"http://{name}.test:8000", pin_pool_ids=pins))
        engine = LLMEngine(client, nodes, EngineConfig(max_num_batched_tokens=256, **config),
                           connect=lambda pool_id, address: RemoteNode(pool_id, address), fleet=member)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
            for node in engine.nodes.values():
                node.close()
            engine.client.close()


@pytest.fixture
def members(services: Services) -> Iterator[Members]:
    m = Members(services)
    try:
        yield m
    finally:
        m.close()


@contextmanager
def idle_loop(engine: LLMEngine) -> Iterator[None]:
    """The engine's idle loop on a thread, as `AsyncLLMEngine` runs it with no request: it
    adopts, hands over and drops pools, and delivers serve grants, while the test drives another
    engine. The test leaves the engine alone meanwhile."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.wait(0.02):
                engine.flush()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors


def settle(*engines: LLMEngine, until: Callable[[], bool], timeout_s: float = 6 * TTL_S, what: str = "") -> float:
    """Flush (the idle loop's work) every engine until `until()`; the seconds it took."""
    t0 = time.monotonic()

    def done() -> bool:
        for e in engines:
            e.flush()
        return until()

    eventually_sync(done, timeout_s=timeout_s, interval_s=0.02, what=what)
    return time.monotonic() - t0


def owners(services: Services) -> dict[str, str]:
    """pool -> owning member, as the block manager sees it."""
    with AdminClient(services.bm.address) as admin:
        return {pool: m.scheduler_id for m in admin.list_schedulers() for pool in m.pool_ids}


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    rids = [engine.add_request(p, params) for p in prompts]
    out = finish(engine, rids)
    return [out[r] for r in rids]


def finish(engine: LLMEngine, rids: list[str], *, on_step: Callable[[list[RequestOutput]], None] | None = None,
           timeout_s: float = 120.0) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(rids):
        assert time.monotonic() < deadline, f"requests not done: {set(rids) - set(done)}"
        outs = engine.step()
        if on_step is not None:
            on_step(outs)
        for o in outs:
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    engine.flush()
    return done


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(length)] for _ in range(n)]


def node_counter(services: Services, node_id: str, name: str) -> float:
    """A counter of an in-process node's metrics (0 when never incremented)."""
    server = next(n for n in services.nodes if n.config.node_id == node_id)
    assert server.node is not None
    return server.node.metrics.registry.get_sample_value(f"{name}_total") or 0.0


def one_node_each(services: Services, a: LLMEngine, b: LLMEngine) -> None:
    settle(a, b, until=lambda: len(a.nodes) == 1 and len(b.nodes) == 1 and set(a.nodes) != set(b.nodes),
           what="one node each")
    assert owners(services) == {**{p: "engine-a" for p in a.nodes}, **{p: "engine-b" for p in b.nodes}}


def test_two_members_share_the_nodes_and_a_silent_ones_node_goes_to_the_other(  # type: ignore[no-untyped-def]
        services, members, hf_models) -> None:
    """The first member owns both nodes, the second joins and gets one (the first hands it over
    when asked); the first stops heartbeating (as a killed process) and the second adopts its
    node once the membership lapses, then serves on both with transformers' tokens."""
    a = members.start("engine-a")
    assert set(a.nodes) == {"node-0", "node-1"} and a.ready
    b = members.start("engine-b")
    one_node_each(services, a, b)
    assert a.fleet_pools is not None and a.fleet_pools.num_released == 1
    hf = hf_models[MODEL]
    for engine, seed in ((a, 1), (b, 2)):   # each serves on its own node
        (prompt,) = prompts(1, 9, seed)
        compare_greedy(run_all(engine, [prompt])[0], hf_greedy(hf, prompt, GREEDY.max_tokens), "own node")

    assert a.fleet is not None
    a.fleet.close()                          # silent: no heartbeat, no leave
    lost = next(iter(a.nodes))
    took = settle(b, until=lambda: set(b.nodes) == {"node-0", "node-1"}, what="the silent member's node adopted")
    assert took < 2 * TTL_S + 1.0, took      # the lapse (a TTL), then the next heartbeat and a probe
    assert owners(services) == {"node-0": "engine-b", "node-1": "engine-b"}
    batch = prompts(4, 10, 3)
    outs = run_all(b, batch)
    assert lost in b.nodes
    for prompt, out in zip(batch, outs):
        compare_greedy(out, hf_greedy(hf, prompt, GREEDY.max_tokens), "after adoption")


def test_a_release_on_rebalance_requeues_without_losing_or_doubling_a_token(  # type: ignore[no-untyped-def]
        services, members, hf_models) -> None:
    """A member running sequences on both nodes is asked to hand one over (a second member
    joined): those sequences are preempted by recompute and finish on its other node; what was
    streamed before stays, nothing is streamed twice, and the tokens equal transformers'."""
    a = members.start("engine-a")
    batch = prompts(6, 11, 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rids = [a.add_request(p, params) for p in batch]
    seen: dict[str, list[int]] = {}

    def check_stream(outs: list[RequestOutput]) -> None:
        for o in outs:
            now = list(o.outputs[0].token_ids)
            before = seen.get(o.request_id, [])
            assert now[: len(before)] == before, (o.request_id, before, now)   # streamed tokens never change
            seen[o.request_id] = now

    for _ in range(6):
        check_stream(a.step())
    assert {s.node_id for s in a.running} == {"node-0", "node-1"}, "the sequences did not spread"
    b = members.start("engine-b")            # its join asks engine-a to release a node
    assert a.fleet is not None and a.fleet_pools is not None
    eventually_sync(lambda: a.fleet.view().release_pool_ids, timeout_s=3 * TTL_S, what="the release request")
    (asked,) = a.fleet.view().release_pool_ids
    on_it = [s for s in a.running if s.node_id == asked]
    assert on_it
    recomputed = a.stats.recomputed_tokens
    with idle_loop(b):
        out = finish(a, rids, on_step=check_stream)
        eventually_sync(lambda: set(b.nodes) == {asked}, timeout_s=3 * TTL_S, what="the released node adopted")
    assert a.fleet_pools.num_released == 1 and asked not in a.nodes
    assert a.stats.recomputed_tokens > recomputed
    hf = hf_models[MODEL]
    for rid, prompt in zip(rids, batch):
        assert out[rid] == seen[rid]
        compare_greedy(out[rid], hf_greedy(hf, prompt, params.max_tokens), f"{rid} across the release")
    one_node_each(services, a, b)
    with AdminClient(services.bm.address) as admin:
        assert admin.fsck().get("ok") is True
        assert all(int(p.get("num_sequences", 0)) == 0 for p in admin.status()["pools"])


def test_a_prefix_cached_on_the_other_members_node_is_fetched(  # type: ignore[no-untyped-def]
        services, members, hf_models) -> None:
    """Engine B serves a prompt whose prefix engine A computed on A's node: B's node fetches it
    node to node (the block manager counts the fetch; A's idle loop delivers the serve grant)
    instead of recomputing it, and the tokens are transformers'."""
    a = members.start("engine-a")
    b = members.start("engine-b")
    one_node_each(services, a, b)
    (a_pool,), (b_pool,) = a.nodes, b.nodes
    rng = random.Random(7)
    prefix = [rng.randrange(1, 512) for _ in range(8 * BS)]
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12, 13]
    hf = hf_models[MODEL]
    compare_greedy(run_all(a, [first])[0], hf_greedy(hf, first, GREEDY.max_tokens), "first on A")
    core = services.bm.runtime.state.core
    fetched_before = core.fetch_counts(b_pool)[0]
    with idle_loop(a):
        out = run_all(b, [second])[0]
    compare_greedy(out, hf_greedy(hf, second, GREEDY.max_tokens), "second on B (fetched)")
    assert b.stats.fetched_tokens == len(prefix)
    assert core.fetch_counts(b_pool)[0] - fetched_before == len(prefix) // BS   # the block manager's counter
    # and the nodes really moved it: B pulled every block (A's idle loop delivered the grant in
    # time), recomputed none of it, and A served them
    assert node_counter(services, b_pool, "pagedkv_cn_fetched_blocks") == len(prefix) // BS
    assert node_counter(services, b_pool, "pagedkv_cn_fetch_recomputed_tokens") == 0
    assert node_counter(services, a_pool, "pagedkv_cn_served_blocks") == len(prefix) // BS
    assert core.fetch_counts(a_pool) == (0, 0)                                  # the loan ended
    with AdminClient(services.bm.address) as admin:
        assert admin.fsck().get("ok") is True


def test_a_member_that_leaves_hands_its_node_over_at_once(services, members) -> None:  # type: ignore[no-untyped-def]
    """Graceful shutdown: the engine frees what it holds and leaves; the other member adopts
    its node well within a TTL (no lapse to wait for)."""
    a = members.start("engine-a")
    b = members.start("engine-b")
    one_node_each(services, a, b)
    (a_pool,) = a.nodes
    a.add_request(prompts(1, 9, 8)[0], GREEDY)
    a.step()
    members.engines.remove(a)
    a.close()
    a.client.close()
    took = settle(b, until=lambda: set(b.nodes) == {"node-0", "node-1"}, what="the leaver's node adopted")
    assert took < TTL_S, took
    assert owners(services) == {"node-0": "engine-b", "node-1": "engine-b"}
    with AdminClient(services.bm.address) as admin:
        assert admin.fsck().get("ok") is True
        pools = {p["pool_id"]: p for p in admin.status()["pools"]}
        assert int(pools[a_pool].get("num_sequences", 0)) == 0


def test_a_paused_member_drops_the_node_it_lost_and_finishes_elsewhere(  # type: ignore[no-untyped-def]
        services, members, hf_models) -> None:
    """A member paused past the TTL (no heartbeat, no step) lost its node to the other member:
    back, it learns so before its next Step, re-queues its sequences there (the handover dropped
    them: nothing to free) and finishes them on a node it owns again, with transformers' tokens."""
    a = members.start("engine-a")
    b = members.start("engine-b")
    one_node_each(services, a, b)
    (a_pool,) = a.nodes
    batch = prompts(2, 10, 9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rids = [a.add_request(p, params) for p in batch]
    for _ in range(3):
        a.step()
    assert a.running and a.fleet is not None and a.fleet_pools is not None
    # Paused: its heartbeat thread waits on this lock past the TTL. Still holding it (the thread
    # stays stuck, as a thread that did not run yet after the process resumed), the engine
    # steps: it must heartbeat before planning, learn the node is gone and not name it (a Step
    # naming another member's pool would be refused whole, stopping the engine).
    with a.fleet._beat_lock:
        settle(b, until=lambda: set(b.nodes) == {"node-0", "node-1"}, what="the paused member's node adopted")
        a.step()
        assert a_pool not in a.nodes and a.fleet_pools.num_lost == 1
        assert all(s.node_id is None for s in a.scheduler.queues.waiting)   # re-queued, holding nothing
    with idle_loop(b):                       # b hands a node back when the fleet asks
        out = finish(a, rids)
    hf = hf_models[MODEL]
    for rid, prompt in zip(rids, batch):
        compare_greedy(out[rid], hf_greedy(hf, prompt, params.max_tokens), f"{rid} after the lost node")
    with AdminClient(services.bm.address) as admin:
        assert admin.fsck().get("ok") is True


def test_a_lone_member_paused_past_the_ttl_gets_its_nodes_back_under_new_leases(  # type: ignore[no-untyped-def]
        services, members, hf_models) -> None:
    """The only member pauses past the TTL: its membership lapses and its leases are released
    (its sequences dropped). Back, it is granted the same nodes under new lease epochs: it keeps
    driving them, but re-queues what it had there (nothing to free) and finishes with
    transformers' tokens."""
    a = members.start("engine-a")
    assert a.fleet is not None and a.fleet_pools is not None
    epochs = dict(a.fleet_pools.epochs)
    batch = prompts(3, 10, 10)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rids = [a.add_request(p, params) for p in batch]
    for _ in range(3):
        a.step()
    held = {s.node_id for s in a.running}
    assert held
    with a.fleet._beat_lock:                 # paused (see the test above)
        eventually_sync(lambda: not owners(services), timeout_s=3 * TTL_S, what="the membership lapsed")
        recomputed = a.stats.recomputed_tokens
        a.step()                             # rejoins first, granted both nodes anew
        assert set(a.nodes) == {"node-0", "node-1"} and a.fleet_pools.num_lost == 2   # both, under new leases
        assert all(a.fleet_pools.epochs[p] > epochs[p] for p in a.nodes)
    out = finish(a, rids)
    assert a.stats.recomputed_tokens > recomputed
    hf = hf_models[MODEL]
    for rid, prompt in zip(rids, batch):
        compare_greedy(out[rid], hf_greedy(hf, prompt, params.max_tokens), f"{rid} under the new lease")
    with AdminClient(services.bm.address) as admin:
        assert admin.fsck().get("ok") is True


def test_a_member_owning_no_node_for_a_ttl_fails_its_queue_and_refuses(services, members) -> None:  # type: ignore[no-untyped-def]
    """A member pinned to a node that does not exist owns none: what it queued fails after a
    TTL (an error another engine may not have: `unavailable`, 503 at the API) and new requests
    are refused, instead of waiting for a node that may never come."""
    from engine.errors import NoNodeOwned

    idle = members.start("engine-idle", pins=("node-9",))
    assert not idle.nodes and not idle.ready
    rid = idle.add_request(prompts(1, 6, 11)[0], GREEDY)        # a moment without a node is no reason yet
    failed: list[RequestOutput] = []
    t0 = time.monotonic()
    while not failed:
        assert time.monotonic() - t0 < 3 * TTL_S, "the queued request was not given up"
        failed += [o for o in idle.step() if o.request_id == rid and o.finished]
    assert time.monotonic() - t0 >= TTL_S * 0.9
    (out,) = failed
    assert out.unavailable and out.error is not None and "owns no model node" in out.error
    assert out.outputs[0].finish_reason == "error"
    with pytest.raises(NoNodeOwned):
        idle.add_request([1, 2, 3], GREEDY)



def test_a_pool_step_for_an_owned_node_not_adopted_yet_adopts_it(services, members) -> None:  # type: ignore[no-untyped-def]
    """The guard of `LLMEngine._deliverable`: a PoolStep for a pool the engine owns but has not
    adopted (its discovery did not get to it) adopts the pool on the spot, so the step reaches
    its node; one for a pool it cannot drive is reported failed, never handed to a missing node."""
    from block_manager.client import PoolStepInfo

    def step_of(pool_id: str) -> PoolStepInfo:
        return PoolStepInfo(pool_id, 1, 1, (), (), (), None, False, 0, None)   # type: ignore[arg-type]

    a = members.start("engine-a")
    b = members.start("engine-b", pins=("node-1",))
    assert b._discovery is not None and b.fleet is not None
    b._discovery.close()                     # B adopts nothing in the background from here on
    settle(a, until=lambda: b.fleet is not None and b.fleet.may_drive("node-1"), what="node-1 handed to B")
    assert not b.nodes
    kept = b._deliverable({"node-1": step_of("node-1"), "node-9": step_of("node-9")})
    assert set(kept) == {"node-1"} and set(b.nodes) == {"node-1"}
    assert b.client.pending_reports["node-9"] == (1, 0, 1)     # reported failed, never sent to a node
