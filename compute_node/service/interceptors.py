"""The compute node's edge: the same error discipline as the block manager's interceptor.

`ErrorMappingInterceptor` wraps every unary handler of `pagedkv.v1.ComputeNode`, each once
(`pagedkv.interceptors`):

- requests whose bytes do not parse arrive as `pagedkv.rpc.Undecodable` (gRPC would answer
  UNKNOWN "Unexpected <class '...DecodeError'>" from inside its deserializer) and are answered
  INVALID_ARGUMENT;
- a typed `ComputeNodeError` that escapes a handler becomes its own status code; anything else
  becomes INTERNAL with a generic message while the exception is logged with its traceback, so
  no exception class or internal detail reaches a caller;
- every status detail is clipped (`pagedkv.rpc.clip`), including those a handler sets itself
  with `context.abort` (the handler gets a context whose `abort` and `set_details` clip; grpc
  sends the status inside `abort`, so it cannot be fixed afterwards): details echo client
  values (sequence ids), and one longer than the peer's metadata limit would reach it as
  RESOURCE_EXHAUSTED instead of the real code.

Health and reflection are not ours and pass through untouched.
"""

from __future__ import annotations

from typing import Any

import grpc

from compute_node.errors import ComputeNodeError
from pagedkv.interceptors import Handler, WrapOnceInterceptor, short_name
from pagedkv.logging import get_logger
from pagedkv.rpc import Undecodable, clip

log = get_logger(__name__)

SERVICE_PREFIX = "/pagedkv.v1.ComputeNode/"
INTERNAL_DETAIL = "internal error (logged on the compute node)"


class ErrorMappingInterceptor(WrapOnceInterceptor):
    def __init__(self) -> None:
        super().__init__(SERVICE_PREFIX)

    def wrap_unary(self, behavior: Handler, method: str) -> Handler:
        return _mapped(behavior, short_name(method))


class _ClippingContext:
    """The servicer context, with every status detail clipped on its way out."""

    __slots__ = ("_context",)

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any) -> None:
        await self._context.abort(code, clip(details), *args, **kwargs)

    def set_details(self, details: str) -> None:
        self._context.set_details(clip(details))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _mapped(behavior: Handler, method: str) -> Handler:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            log.info("rpc_rejected", rpc=method, code="INVALID_ARGUMENT", error=request.error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {request.error}")
        try:
            return await behavior(request, _ClippingContext(context))
        except grpc.aio.AbortError:
            raise
        except ComputeNodeError as exc:
            detail = clip(str(exc) or type(exc).__name__)
            log.info("rpc_rejected", rpc=method, code=exc.code.name, error=detail)
            await context.abort(exc.code, detail)
        except Exception:  # noqa: BLE001 - the single mapping point
            log.exception("rpc_failed", rpc=method)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_DETAIL)

    return call


__all__ = ["ErrorMappingInterceptor"]
