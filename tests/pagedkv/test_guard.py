"""`pagedkv.guard.EdgeGuard` on a real server: calls in flight per peer, expired deadlines,
and that only the service's own methods are guarded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pagedkv.auth import Authenticator, AuthSettings
from pagedkv.guard import EdgeGuard, peer_host
from pagedkv.lifecycle import bind, new_server
from tests.support.polling import eventually

SLOW = "/pagedkv.test.Toy/Slow"
OPEN = "/other.Toy/Slow"
TOKENS = {"scheduler:a": "a" * 20, "scheduler:b": "b" * 20}


class Toy(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.started += 1
        await self.release.wait()
        return request

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return grpc.unary_unary_rpc_method_handler(self.slow) if details.method in (SLOW, OPEN) else None


@pytest.fixture
async def toy() -> AsyncIterator[tuple[Toy, EdgeGuard, grpc.aio.Channel]]:
    handler = Toy()
    guard = EdgeGuard(authenticator=Authenticator(AuthSettings(tokens=TOKENS)), max_inflight_per_peer=2,
                      authorize=lambda method, principal, request: None)
    server = new_server([guard])
    server.add_generic_rpc_handlers((handler,))
    port = bind(server, "127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield handler, guard, channel
    finally:
        handler.release.set()
        await channel.close()
        await server.stop(0)


def call(channel: grpc.aio.Channel, who: str, method: str = SLOW) -> Any:
    return channel.unary_unary(method)(b"x", metadata=(("authorization", f"Bearer {TOKENS[who]}"),), timeout=20)


async def test_calls_in_flight_are_capped_per_principal(toy: Any) -> None:
    handler, guard, channel = toy
    a1, a2 = asyncio.ensure_future(call(channel, "scheduler:a")), asyncio.ensure_future(call(channel, "scheduler:a"))
    await eventually(lambda: handler.started == 2, what="two calls of a in flight")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(channel, "scheduler:a")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    b1 = asyncio.ensure_future(call(channel, "scheduler:b"))                  # another peer has its own budget
    await eventually(lambda: handler.started == 3, what="b's call in flight")
    assert guard.inflight == {"scheduler:a": 2, "scheduler:b": 1}
    handler.release.set()
    assert await asyncio.gather(a1, a2, b1) == [b"x"] * 3
    assert guard.inflight == {}
    assert await call(channel, "scheduler:a") == b"x"


async def test_only_our_methods_are_guarded(toy: Any) -> None:
    handler, _, channel = toy
    handler.release.set()
    assert await channel.unary_unary(OPEN)(b"y", timeout=20) == b"y"          # no credentials needed
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary(SLOW)(b"y", timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.code: grpc.StatusCode | None = None

    def time_remaining(self) -> float | None:
        return self.remaining

    def peer(self) -> str:
        return "ipv4:10.0.0.9:4242"

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


async def test_a_call_whose_deadline_passed_is_not_started() -> None:
    ran: list[Any] = []

    async def behavior(request: Any, context: Any) -> str:
        ran.append(request)
        return "done"

    guard = EdgeGuard(max_inflight_per_peer=4)
    call_ = guard.wrap_unary(behavior, SLOW)   # no authenticator: no identity check
    late = FakeContext(0.0)
    with pytest.raises(Aborted):
        await call_("late", late)
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED and ran == []
    assert await call_("in time", FakeContext(1.0)) == "done"
    assert await call_("no deadline", FakeContext(None)) == "done"
    assert ran == ["in time", "no deadline"] and guard.inflight == {}


def test_peer_host() -> None:
    assert peer_host("ipv4:10.0.0.5:51234") == "ipv4:10.0.0.5"
    assert peer_host("ipv6:[::1]:5") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/x") == "unix:/tmp/x"
