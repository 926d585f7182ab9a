"""An in-process block manager (and an optional fault-injecting proxy) on a background
event loop, so synchronous clients, asyncio clients and `admin_cli.main` can all talk to it.

`FaultProxy` forwards raw bytes of any unary RPC to the real server; a scripted fault can
make a call fail with UNAVAILABLE *after* the server acted (the case request-id replay
exists for) or delay it past the client's deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import Coroutine
from typing import Any

import grpc

from block_manager.service.server import BlockManagerServer
from tests.support.configs import bm_test_config


def service_config(**overrides: Any) -> Any:
    """Test defaults (`tests/support/configs.py`) with the client tests' block size 8."""
    return bm_test_config(**{"block_size": 8, **overrides})


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bm-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class FaultProxy:
    """Generic unary proxy: `fail_after_forward(method)` / `delay(method, s)` script the
    next calls of a method (short name, e.g. "Free")."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults: dict[str, deque[tuple[str, Any]]] = defaultdict(deque)
        self.calls: list[str] = []
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    def fail_after_forward(self, method: str, times: int = 1,
                           code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """The next `times` calls reach the server, and the client gets `code` instead of
        the answer (UNAVAILABLE: the connection broke; CANCELLED: the server stopped mid-call)."""
        self.faults[method].extend([("fail", code)] * times)

    def delay(self, method: str, seconds: float, times: int = 1) -> None:
        self.faults[method].extend([("delay", seconds)] * times)

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.upstream)
        proxy = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                return grpc.unary_unary_rpc_method_handler(proxy._make(details.method))

        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((Handler(),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def _make(self, method: str) -> Any:
        short = method.rsplit("/", 1)[-1]

        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.calls.append(short)
            fault = self.faults[short].popleft() if self.faults[short] else None
            if fault is not None and fault[0] == "delay":
                await asyncio.sleep(fault[1])
            assert self._channel is not None
            md = tuple((k, v) for k, v in context.invocation_metadata() or () if k == "authorization")
            try:
                response = await self._channel.unary_unary(method)(request, metadata=md, timeout=30)
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            if fault is not None and fault[0] == "fail":
                await context.abort(fault[1], "injected: the answer was lost after the server acted")
            return response

        return behavior

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()


class ServerThread:
    """A `BlockManagerServer` on a background loop; `address` is 127.0.0.1:<ephemeral>."""

    def __init__(self, **overrides: Any) -> None:
        self.lt = LoopThread()
        self.server = BlockManagerServer(service_config(**overrides))
        self.lt.run(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"
        self.proxy: FaultProxy | None = None

    def start_proxy(self) -> FaultProxy:
        self.proxy = FaultProxy(self.address)
        self.lt.run(self.proxy.start())
        return self.proxy

    @property
    def state(self) -> Any:
        return self.server.runtime.state  # type: ignore[union-attr]

    def fsck(self) -> list[str]:
        async def run() -> list[str]:
            return self.state.fsck()

        return self.lt.run(run())

    def stop(self) -> None:
        if self.proxy is not None:
            self.lt.run(self.proxy.stop())
        self.lt.run(self.server.stop(0))
        self.lt.close()
