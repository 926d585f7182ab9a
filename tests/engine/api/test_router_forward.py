"""pagedkv-router's pass-through over real sockets, with static `--engines` (no block manager):
streams relayed byte for byte and as they arrive, retries before the first byte only, an engine
that dies mid-stream reported to the client, the router's API key, /health and /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.compute_node.model.model_helpers import tiny_model_dir
from tests.engine.api.router_fakes import FakeEngine, RouterThread, dead_url
from tests.engine.conftest import SPECS

COMPLETION = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(model_root: Path) -> Path:
    return tiny_model_dir(model_root, **{**SPECS["llama-gqa4-hd64"], "seed": 11})


@pytest.fixture
def engine_a() -> Iterator[FakeEngine]:
    with FakeEngine("a") as e:
        yield e


def _stream(url: str, body: dict[str, object], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=20) as r:
        return r.status_code, r.read()


def test_completion_and_stream_pass_through_byte_for_byte(model_dir: Path) -> None:
    with FakeEngine("a", split_events=True) as a, RouterThread(model_dir, engines=[a.url]) as rt:
        direct = _stream(a.url, COMPLETION)
        routed = _stream(rt.url, COMPLETION)
        assert direct == routed == (200, a.stream_bytes())
        whole = httpx.post(rt.url + "/v1/completions", json=COMPLETION, timeout=20)
        assert whole.status_code == 200 and whole.json()["engine"] == "a"
        assert [r.body for r in a.received] == [{**COMPLETION, "stream": True}] * 2 + [COMPLETION]
        chat = httpx.post(rt.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          timeout=20)
        assert chat.status_code == 200 and a.received[-1].path == "/v1/chat/completions"
        models = httpx.get(rt.url + "/v1/models", timeout=20)
        assert models.json()["data"][0]["owned_by"] == "a"
        assert rt.metric("pagedkv_router_routed_static_total") == 3     # generations; /v1/models is not counted
        assert rt.metric("pagedkv_router_engine_requests_total", engine=a.url) == 4


def test_a_stream_is_relayed_as_it_arrives(model_dir: Path) -> None:
    """The engine holds its stream after the first event until the client has read that event
    through the router: a router that buffered would never deliver it (the read times out)."""
    gate = threading.Event()
    with FakeEngine("a", gate=gate) as a, RouterThread(model_dir, engines=[a.url]) as rt:
        with httpx.stream("POST", rt.url + "/v1/completions", json={**COMPLETION, "stream": True},
                          timeout=httpx.Timeout(5.0)) as r:
            lines = r.iter_lines()
            assert next(lines) == a.event(0).decode().strip()
            assert not gate.is_set()
            gate.set()
            rest = "\n".join(lines)
        assert rest.strip().endswith("data: [DONE]")


def test_a_client_leaving_mid_stream_closes_the_engines_stream(model_dir: Path) -> None:
    """The engine aborts a generation whose client went away: through the router it must see
    the client go away too (the router closes its upstream stream)."""
    gate = threading.Event()
    with FakeEngine("a", gate=gate) as a, RouterThread(model_dir, engines=[a.url]) as rt:
        with httpx.stream("POST", rt.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10) as r:
            lines = r.iter_lines()
            next(lines)
        deadline = time.monotonic() + 5
        while a.num_aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.num_aborted == 1
        assert rt.router.fleet.statics[a.url].num_in_flight == 0


def test_a_refused_connection_is_retried_on_the_next_engine(model_dir: Path, engine_a: FakeEngine) -> None:
    """Idle engines take turns, so the dead one comes first within two requests; once it failed
    it cools down (tried last), so three requests cost exactly one refused connection."""
    down = dead_url()
    with RouterThread(model_dir, engines=[engine_a.url, down]) as rt:
        for _ in range(3):
            assert _stream(rt.url, COMPLETION) == (200, engine_a.stream_bytes())
        assert len(engine_a.received) == 3
        assert rt.metric("pagedkv_router_engine_failures_total", engine=down, reason="connect") == 1
        assert rt.metric("pagedkv_router_retries_total") == 1
        assert rt.router.fleet.statics[down].cooling(time.monotonic())


def test_idle_engines_take_turns(model_dir: Path) -> None:
    """Equal loads: new prompts are spread over the engines, not all sent to the first one."""
    with FakeEngine("a") as a, FakeEngine("b") as b, RouterThread(model_dir, engines=[a.url, b.url]) as rt:
        for _ in range(4):
            httpx.post(rt.url + "/v1/completions", json=COMPLETION, timeout=20)
        assert (len(a.received), len(b.received)) == (2, 2)


def test_a_5xx_before_the_first_byte_is_retried_and_the_last_one_passed_on(model_dir: Path,
                                                                           engine_a: FakeEngine) -> None:
    with FakeEngine("sick", fail_status=503) as sick:
        with RouterThread(model_dir, engines=[sick.url, engine_a.url]) as rt:
            for _ in range(3):
                assert _stream(rt.url, COMPLETION) == (200, engine_a.stream_bytes())
            assert len(sick.received) == 1                   # then it cools down
            assert rt.metric("pagedkv_router_engine_failures_total", engine=sick.url, reason="status_5xx") == 1
            assert rt.metric("pagedkv_router_retries_total") == 1
        with RouterThread(model_dir, engines=[sick.url]) as rt:
            status, body = _stream(rt.url, COMPLETION)
            assert status == 503 and b"sick fails" in body        # the only engine's answer, as it is
            assert rt.metric("pagedkv_router_retries_total") == 0


def test_every_engine_down_is_a_503(model_dir: Path) -> None:
    with RouterThread(model_dir, engines=[dead_url(), dead_url()]) as rt:
        r = httpx.post(rt.url + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert rt.metric("pagedkv_router_retries_total") == 1


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error(model_dir: Path, engine_a: FakeEngine) -> None:
    """Bytes have flowed: no retry (the client has tokens from the dead engine); the whole events
    it sent are relayed, then an error event and [DONE]."""
    with FakeEngine("dying", die_after=2, split_events=True) as dying, \
            RouterThread(model_dir, engines=[dying.url]) as rt:
        status, body = _stream(rt.url, COMPLETION)
        assert status == 200
        events = body.split(b"\n\n")
        assert body.startswith(dying.event(0) + dying.event(1))
        assert b'"code":"upstream_disconnected"' in events[2] and events[3] == b"data: [DONE]"
        assert len(dying.received) == 1 and not engine_a.received
        assert rt.metric("pagedkv_router_engine_failures_total", engine=dying.url, reason="broken") == 1
        assert rt.metric("pagedkv_router_retries_total") == 0


def test_the_routers_api_key(model_dir: Path, engine_a: FakeEngine) -> None:
    with RouterThread(model_dir, engines=[engine_a.url], api_key="router-key-0123456789") as rt:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic router-key-0123456789"}):
            r = httpx.post(rt.url + "/v1/completions", json=COMPLETION, headers=headers, timeout=20)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(rt.url + "/v1/models", timeout=20).status_code == 401
        assert not engine_a.received
        ok = {"Authorization": "Bearer router-key-0123456789"}
        assert _stream(rt.url, COMPLETION, ok) == (200, engine_a.stream_bytes())
        assert engine_a.received[0].headers["authorization"] == ok["Authorization"]   # the engine checks it too
        assert httpx.get(rt.url + "/health", timeout=20).status_code == 200             # probes need no key
        assert httpx.get(rt.url + "/metrics", timeout=20).status_code == 200


def test_health_needs_a_known_engine_and_unknown_routes_are_404(model_dir: Path) -> None:
    with RouterThread(model_dir) as rt:
        r = httpx.get(rt.url + "/health", timeout=20)
        assert r.status_code == 503 and "no engine known" in r.json()["detail"]
        r = httpx.post(rt.url + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine"
        assert httpx.get(rt.url + "/v2/nothing", timeout=20).status_code == 404
    with FakeEngine("a") as a, RouterThread(model_dir, engines=[a.url]) as rt:
        assert httpx.get(rt.url + "/health", timeout=20).json() == {"status": "ok", "engines": 1}


def test_static_engines_are_balanced_by_in_flight_requests(model_dir: Path) -> None:
    """With a stream held open on one engine, the next request goes to the other."""
    gate = threading.Event()
    with FakeEngine("a", gate=gate) as a, FakeEngine("b", gate=gate) as b, \
            RouterThread(model_dir, engines=[a.url, b.url]) as rt:
        with httpx.stream("POST", rt.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10) as r:
            lines = r.iter_lines()      # kept: a dropped iterator closes the stream
            next(lines)
            first = a if a.received else b
            other = b if first is a else a
            deadline = time.monotonic() + 5
            while not rt.router.fleet.statics[first.url].num_in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            httpx.post(rt.url + "/v1/completions", json=COMPLETION, timeout=10)
            assert len(other.received) == 1 and len(first.received) == 1
            gate.set()
