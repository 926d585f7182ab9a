"""The servers' edge interceptor, shared by the block manager and the compute node.

Both services turn whatever escapes a handler into a status in one place (each service's
`ErrorMappingInterceptor`), and both need the same plumbing around that mapping, which lives
here so it cannot drift between them:

- only the service's own methods are wrapped (health and reflection pass through untouched);
- each method is wrapped once and the wrapper kept: the registered handlers never change, and
  the interceptor runs on every call of the hot path (a Step, a Forward);
- requests are parsed tolerantly (`pagedkv.rpc.tolerant_deserializer`; `tolerant=False`
  keeps the handler's own parser), so bytes that do not parse reach the wrapper as
  `Undecodable` and can be answered INVALID_ARGUMENT instead of gRPC's UNKNOWN.

Three interceptors are built on it: the edge guard (`pagedkv.guard`) and each service's error
mapping.

A service says which methods are its own (`prefix`) and how one behaviour is wrapped
(`wrap_unary`, and with `wrap_streams` also `wrap_stream` for server-streaming methods).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pagedkv.rpc import wrap_unary_handler, wrap_unary_stream_handler

# A unary handler's behaviour: (request, context) -> awaitable response.
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class WrapOnceInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each handler of the methods under `prefix` once (see the module docstring)."""

    def __init__(self, prefix: str, *, wrap_streams: bool = False, tolerant: bool = True) -> None:
        self._prefix = prefix
        self._wrap_streams = wrap_streams   # server-streaming methods too (`wrap_stream`)
        self._tolerant = tolerant           # parse requests with `tolerant_deserializer`
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None or not method.startswith(self._prefix):
            return handler  # unknown method, health, reflection: not ours to map
        tolerant = self._tolerant
        wrapped = wrap_unary_handler(handler, lambda behavior: self.wrap_unary(behavior, method), tolerant=tolerant)
        if self._wrap_streams:
            wrapped = wrap_unary_stream_handler(
                wrapped, lambda behavior: self.wrap_stream(behavior, method), tolerant=tolerant)
        self._wrapped[method] = wrapped
        return wrapped

    def wrap_unary(self, behavior: Handler, method: str) -> Handler:
        """The behaviour of unary method `method` (its full name, `/package.Service/Method`),
        wrapped."""
        raise NotImplementedError

    def wrap_stream(self, behavior: Any, method: str) -> Any:
        """The behaviour of server-streaming method `method`, wrapped (with `wrap_streams`)."""
        return behavior


def short_name(method: str) -> str:
    """`/pagedkv.v1.BlockManager/Step` -> `Step` (what logs and metrics call a method)."""
    return method.rsplit("/", 1)[-1]


__all__ = ["Handler", "WrapOnceInterceptor", "short_name"]
