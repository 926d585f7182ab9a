"""pagedkv-router over a real block manager in fleet mode: two pools, each owned by a member
(a scheduler that heartbeats with its API address), prefixes made cached by the members' own
Steps; the router sends each request to the owner of the longest cached prefix of its prompt,
else to the least loaded member, retries a dead owner's request on the other member, and is
ready exactly while it knows an engine. Upstream engines are fake ones on real sockets."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from block_manager.client import BlockManagerClient
from engine.api.router import prompt_of
from engine.tokenizer import Tokenizer
from tests.block_manager.client.server_thread import ServerThread as BlockManagerThread
from tests.compute_node.model.model_helpers import tiny_model_dir
from tests.engine.api.router_fakes import FakeEngine, RouterThread, dead_url
from tests.engine.conftest import SPECS

SYSTEM = "You are a helpful assistant. Answer briefly and in full sentences, please. "
_seq = itertools.count()


@pytest.fixture(scope="module")
def model_dir(model_root: Path) -> Path:
    return tiny_model_dir(model_root, **{**SPECS["llama-gqa4-hd64"], "seed": 11})


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def bm() -> Iterator[BlockManagerThread]:
    st = BlockManagerThread()
    with BlockManagerClient(st.address, timeout_s=5) as nodes:
        for pool in ("n1", "n2"):
            nodes.register_node(pool, 64, geometry={"num_layers": 2, "dtype": "float16"}, address="127.0.0.1:9")
    yield st
    if not getattr(st, "stopped", False):
        st.stop()


@pytest.fixture
def engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    with FakeEngine("a") as a, FakeEngine("b") as b:
        yield a, b


class Member:
    """A fleet member as the block manager sees it: the scheduler of one API replica, pinned to
    one pool, reporting `url` as its address and the load it is given."""

    def __init__(self, bm: BlockManagerThread, name: str, url: str, pool: str) -> None:
        self.client = BlockManagerClient(bm.address, scheduler_id=name, timeout_s=5)
        self.url, self.pool = url, pool
        self.heartbeat()

    def heartbeat(self, num_running: int = 0, num_waiting: int = 0, leave: bool = False) -> None:
        owned = self.client.scheduler_heartbeat(address=self.url, pin_pool_ids=[self.pool], num_running=num_running,
                                                num_waiting=num_waiting, leave=leave)
        assert [p.pool_id for p in owned.pools] == ([] if leave else [self.pool])

    def cache(self, token_ids: list[int], salt: str | None = None) -> None:
        """Prefill `token_ids` on its pool and free the sequence: its full blocks stay cached."""
        seq = f"{self.pool}-seq-{next(_seq)}"
        step = self.client.step()
        step.allocate(seq, self.pool, token_ids, salt=salt)
        for pool_step in step.commit().steps.values():
            self.client.report(pool_step, ok=True)
        self.client.free([seq])

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def members(bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine]) -> Iterator[tuple[Member, Member]]:
    a, b = Member(bm, "engine-a", engines[0].url, "n1"), Member(bm, "engine-b", engines[1].url, "n2")
    yield a, b
    a.close()
    b.close()


def _complete(rt: RouterThread, prompt: str, **extra: object) -> httpx.Response:
    r = httpx.post(rt.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra}, timeout=20)
    assert r.status_code == 200, r.text
    return r


def _eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_requests_go_to_the_owner_of_the_longest_cached_prefix(
        model_dir: Path, tokenizer: Tokenizer, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine],
        members: tuple[Member, Member]) -> None:
    (a, b), (ma, mb) = engines, members
    ma.heartbeat(num_running=0)
    mb.heartbeat(num_running=10)             # by load the router would pick a: the prefix must win
    on_b, on_a = SYSTEM + "What is a paged KV cache?", SYSTEM[::-1] + "Name three prime numbers."
    mb.cache(tokenizer.encode(on_b))
    ma.cache(tokenizer.encode(on_a))
    with RouterThread(model_dir, block_manager=bm.address) as rt:
        _complete(rt, on_b)
        _complete(rt, on_b + " And why does it help?")     # a longer prompt over the same prefix
        _complete(rt, on_a)
        assert [r.body["prompt"][:20] for r in b.received] == [on_b[:20]] * 2
        assert [r.body["prompt"] for r in a.received] == [on_a]
        assert rt.metric("pagedkv_router_routed_by_prefix_total") == 3
        assert rt.metric("pagedkv_router_routed_by_load_total") == 0
        cached = rt.metric("pagedkv_router_prefix_cached_tokens_total")
        assert 0 < cached <= rt.metric("pagedkv_router_prompt_tokens_total")


def test_a_prefix_owner_far_busier_than_the_least_loaded_member_gives_way(
        model_dir: Path, tokenizer: Tokenizer, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine],
        members: tuple[Member, Member]) -> None:
    """Beyond `max_imbalance` requests more than the least loaded member, the prefix owner's
    traffic goes there (its node fetches the prefix) instead of queueing behind the owner."""
    (a, b), (_, mb) = engines, members
    prompt = SYSTEM + "A hot system prompt."
    mb.cache(tokenizer.encode(prompt))
    mb.heartbeat(num_running=6, num_waiting=3)                 # 9 more than a
    with RouterThread(model_dir, block_manager=bm.address, max_imbalance=9) as rt:
        _complete(rt, prompt)
        assert (len(a.received), len(b.received)) == (0, 1)    # 9 is not more than 9: the owner serves
    with RouterThread(model_dir, block_manager=bm.address, max_imbalance=8) as rt:
        _complete(rt, prompt)
        assert (len(a.received), len(b.received)) == (1, 1)
        assert rt.metric("pagedkv_router_routed_by_balance_total") == 1
        assert rt.metric("pagedkv_router_routed_by_prefix_total") == 0


def test_without_a_cached_prefix_the_least_loaded_member_serves(
        model_dir: Path, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine],
        members: tuple[Member, Member]) -> None:
    (a, b), (ma, mb) = engines, members
    ma.heartbeat(num_running=3, num_waiting=4)
    mb.heartbeat(num_running=1)
    with RouterThread(model_dir, block_manager=bm.address, refresh_s=0.1) as rt:
        _complete(rt, "nothing cached here")
        assert (len(a.received), len(b.received)) == (0, 1)
        mb.heartbeat(num_running=5, num_waiting=5)          # b is now the busier one
        _complete(rt, "nor here")                          # the Route answer carries the new loads
        assert (len(a.received), len(b.received)) == (1, 1)
        assert rt.metric("pagedkv_router_routed_by_load_total") == 2
        assert rt.metric("pagedkv_router_engine_load", engine=a.url, kind="waiting") == 4


def test_chat_and_cache_salt_route_on_the_engines_own_rendering(
        model_dir: Path, tokenizer: Tokenizer, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine],
        members: tuple[Member, Member]) -> None:
    """The ids cached are those the engine's server computes for a chat (its template, no BOS
    added) and for a salted prompt; the router finds them, so it computed the same ids."""
    (a, b), (ma, mb) = engines, members
    ma.heartbeat(num_running=9)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about blocks."}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ma.cache(tokenizer.encode(rendered, add_special_tokens=False))
    mb.heartbeat(num_running=9)
    salted = SYSTEM + "A question only tenant-7 asks."
    mb.cache(tokenizer.encode(salted), salt="tenant-7")
    ma.heartbeat(num_running=0)              # by load a now; the salted prefix is on b
    with RouterThread(model_dir, block_manager=bm.address) as rt:
        r = httpx.post(rt.url + "/v1/chat/completions", json={"messages": messages}, timeout=20)
        assert r.status_code == 200 and len(a.received) == 1
        _complete(rt, salted, cache_salt="tenant-7")
        assert len(b.received) == 1
        _complete(rt, salted)                 # unsalted: nothing cached for it, by load
        assert len(a.received) == 2
        assert rt.metric("pagedkv_router_routed_by_prefix_total") == 2


def test_prompt_of_reads_requests_as_the_engine_does(tokenizer: Tokenizer) -> None:
    import json

    def body(**fields: object) -> bytes:
        return json.dumps(fields).encode()

    assert prompt_of("/v1/completions", body(prompt="hello world"), tokenizer) == (
        tokenizer.encode("hello world"), None)
    assert prompt_of("/v1/completions", body(prompt="hi", add_special_tokens=False, cache_salt="s"), tokenizer) == (
        tokenizer.encode("hi", add_special_tokens=False), "s")
    assert prompt_of("/v1/completions", body(prompt=[[5, 6, 7], [8]]), tokenizer) == ([5, 6, 7], None)
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    ids, _ = prompt_of("/v1/chat/completions", body(messages=chat), tokenizer) or ([], None)
    joined = [{"role": "user", "content": "a\nb"}]                       # text parts joined as the engine joins them
    flat = tokenizer.apply_chat_template(joined, add_generation_prompt=True)
    assert ids == tokenizer.encode(flat, add_special_tokens=False)
    for bad in (b"not json", body(prompt=[]), body(prompt=[10**9]), body(messages="x"), b"[1]"):
        path = "/v1/chat/completions" if b"messages" in bad else "/v1/completions"
        assert prompt_of(path, bad, tokenizer) is None        # routed by load; the engine answers the error


def test_a_dead_owner_is_retried_on_the_other_member(
        model_dir: Path, tokenizer: Tokenizer, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine]) -> None:
    """The owner of the cached prefix refuses connections (its process died, its lease has not
    lapsed yet): the request is served by the other member, not failed, and the next one goes
    there directly."""
    _, b = engines
    down = dead_url()
    dead, alive = Member(bm, "engine-dead", down, "n1"), Member(bm, "engine-b", b.url, "n2")
    try:
        dead.cache(tokenizer.encode(SYSTEM + "cached on the dead one"))
        with RouterThread(model_dir, block_manager=bm.address) as rt:
            _complete(rt, SYSTEM + "cached on the dead one")
            assert len(b.received) == 1
            assert rt.metric("pagedkv_router_routed_by_prefix_total") == 1
            assert rt.metric("pagedkv_router_engine_failures_total", engine=down, reason="connect") == 1
            assert rt.metric("pagedkv_router_retries_total") == 1
            _complete(rt, SYSTEM + "cached on the dead one")   # its owner cools down: no second failed attempt
            assert len(b.received) == 2
            assert rt.metric("pagedkv_router_routed_by_load_total") == 1
            assert rt.metric("pagedkv_router_retries_total") == 1
    finally:
        dead.close()
        alive.close()


def test_readiness_follows_the_fleet_and_static_engines_serve_until_it_has_members(
        model_dir: Path, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine]) -> None:
    a, b = engines
    with RouterThread(model_dir, block_manager=bm.address, refresh_s=0.1) as rt:
        assert httpx.get(rt.url + "/health", timeout=10).status_code == 503
        joined = Member(bm, "engine-a", a.url, "n1")
        _eventually(lambda: httpx.get(rt.url + "/health", timeout=10).status_code == 200)
        joined.heartbeat(leave=True)
        _eventually(lambda: httpx.get(rt.url + "/health", timeout=10).status_code == 503)
        joined.close()
    with RouterThread(model_dir, block_manager=bm.address, engines=[b.url], refresh_s=0.1) as rt:
        _complete(rt, "no member yet")
        assert len(b.received) == 1 and rt.metric("pagedkv_router_routed_static_total") == 1
        joined = Member(bm, "engine-a", a.url, "n1")
        _eventually(lambda: bool(rt.router.fleet.members))
        _complete(rt, "a member now")
        assert len(a.received) == 1 and rt.metric("pagedkv_router_routed_by_load_total") == 1
        joined.close()


def test_an_unanswered_route_sends_by_load_to_the_members_known(
        model_dir: Path, bm: BlockManagerThread, engines: tuple[FakeEngine, FakeEngine],
        members: tuple[Member, Member]) -> None:
    a, b = engines
    with RouterThread(model_dir, block_manager=bm.address, refresh_s=60, route_timeout_s=0.5) as rt:
        _complete(rt, "the block manager answers this one")
        bm.stop()
        bm.stopped = True   # type: ignore[attr-defined]
        _complete(rt, "and not this one")
        assert len(a.received) + len(b.received) == 2
        assert rt.metric("pagedkv_router_route_errors_total") == 1
        assert rt.metric("pagedkv_router_routed_by_load_total") == 2
