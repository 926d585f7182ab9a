"""The block manager inside the engine's own process: no server, no socket, no journal.

`LocalBlockManagerClient` is the ordinary sync client (`BlockManagerClient`: step helper,
tracker, reports, deferred in-block appends) whose channel dispatches each call straight to the
service's state machine (`ServiceState`) in this process, through the very conversions the gRPC
servicer uses. So an embedded engine (`LLM(model=...)` with no `block_manager=` address) runs
the same protocol, the same checks and the same code paths as one talking to a remote block
manager; only the transport differs. Nothing is durable: the state lives as long as the client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from block_manager.client import BlockManagerClient, RetryPolicy
from block_manager.core.errors import CoreError
from block_manager.service.config import BlockManagerConfig
from block_manager.service.errors import ServiceError
from block_manager.service.servicer import (
    register_payload,
    register_response,
    route_response,
    step_response,
)
from block_manager.service.state import ServiceState
from block_manager.service.status import clip, status_for
from block_manager.service.step_codec import ReceivedStep
from pagedkv.v1 import block_manager_pb2 as pb


class LocalRpcError(grpc.RpcError):
    """A domain error of a local call, shaped like the gRPC error the client maps."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _LocalChannel:
    """Just enough of `grpc.Channel` for the generated stub: each method is a local call."""

    def __init__(self, handlers: dict[str, Callable[[Any], Any]]) -> None:
        self._handlers = handlers

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    **_: Any) -> Callable[..., Any]:
        name = method.rsplit("/", 1)[-1]
        handler = self._handlers.get(name)

        def call(request: Any, timeout: float | None = None, **_: Any) -> Any:
            if handler is None:
                raise LocalRpcError(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served in-process")
            try:
                return handler(request)
            except (CoreError, ServiceError) as exc:
                code = status_for(exc) or grpc.StatusCode.INTERNAL
                raise LocalRpcError(code, clip(str(exc))) from exc

        return call

    # the stub also asks for these shapes; none is used by the client
    unary_stream = stream_unary = stream_stream = unary_unary

    def close(self) -> None:
        pass


class LocalBlockManagerClient(BlockManagerClient):
    """A `BlockManagerClient` over an in-process block manager (see the module docstring)."""

    def __init__(self, config: BlockManagerConfig | None = None, *, scheduler_id: str = "engine") -> None:
        self.config = config or BlockManagerConfig(database_url="memory://")
        self.state = ServiceState(self.config.state_config())
        channel = _LocalChannel({"RegisterNode": self._register, "Step": self._step, "Route": self._route})
        # local calls never time out or lose their answer: nothing to retry
        super().__init__("in-process", channel=channel, retry=RetryPolicy(max_attempts=1),
                         scheduler_id=scheduler_id)

    def _register(self, request: pb.RegisterNodeRequest) -> pb.RegisterNodeResponse:
        return register_response(self.state.apply("register_node", register_payload(request), time.monotonic()).result)

    def _step(self, request: pb.StepRequest) -> pb.StepResponse:
        step = ReceivedStep(request).decode(self.state.config.max_batch)   # no journal: no payload dict
        answer, _ = self.state.step_answer(step, time.monotonic())   # typed answer: no JSON form either
        return step_response(answer)

    def _route(self, request: pb.RouteRequest) -> pb.RouteResponse:
        return route_response(self.state, request)


__all__ = ["LocalBlockManagerClient", "LocalRpcError"]
