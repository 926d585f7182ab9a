"""`WrapOnceInterceptor`, the edge plumbing both services' error-mapping interceptors share: only
the service's own methods are wrapped, each once, and their requests are parsed tolerantly."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc

from pagedkv.interceptors import Handler, WrapOnceInterceptor, short_name
from pagedkv.rpc import Undecodable
from pagedkv.v1 import block_manager_pb2 as pb


class _Tagging(WrapOnceInterceptor):
    """Answers every call of its service with what its behaviour answered, tagged."""

    def wrap_unary(self, behavior: Handler, method: str) -> Handler:
        name = short_name(method)

        async def call(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                return f"{name}: undecodable"
            return f"{name}: {await behavior(request, context)}"

        return call


def _handler() -> Any:
    async def behavior(request: Any, context: Any) -> str:
        return request.node_id

    return grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=pb.HeartbeatRequest.FromString,
        response_serializer=lambda s: s.encode())


async def _intercept(icpt: WrapOnceInterceptor, method: str, continued: list[str]) -> Any:
    async def continuation(details: Any) -> Any:
        continued.append(details.method)
        return _handler()

    return await icpt.intercept_service(continuation, SimpleNamespace(method=method))


def test_own_methods_are_wrapped_once_and_parsed_tolerantly() -> None:
    icpt = _Tagging("/pagedkv.v1.Toy/")
    continued: list[str] = []

    async def run() -> None:
        first = await _intercept(icpt, "/pagedkv.v1.Toy/Heartbeat", continued)
        again = await _intercept(icpt, "/pagedkv.v1.Toy/Heartbeat", continued)
        assert first is again and continued == ["/pagedkv.v1.Toy/Heartbeat"]
        good = first.request_deserializer(pb.HeartbeatRequest(node_id="n1").SerializeToString())
        assert await first.unary_unary(good, None) == "Heartbeat: n1"
        bad = first.request_deserializer(b"\xff\xff")
        assert isinstance(bad, Undecodable) and await first.unary_unary(bad, None) == "Heartbeat: undecodable"
        other = await _intercept(icpt, "/grpc.health.v1.Health/Check", continued)
        assert await other.unary_unary(good, None) == "n1"   # not ours: untouched

    asyncio.run(run())


def test_a_strict_interceptor_keeps_the_handlers_parser() -> None:
    icpt = _Tagging("/pagedkv.v1.Toy/", tolerant=False)   # as the edge guard, outside the error mapping

    async def run() -> None:
        wrapped = await _intercept(icpt, "/pagedkv.v1.Toy/Heartbeat", [])
        assert wrapped.request_deserializer == pb.HeartbeatRequest.FromString
        assert await wrapped.unary_unary(pb.HeartbeatRequest(node_id="n2"), None) == "Heartbeat: n2"

    asyncio.run(run())
