"""Server interceptor: the ONE place domain errors become statuses.

`ErrorMappingInterceptor` wraps every unary handler (and, without the latency histogram, the
server-streaming SubscribeKvEvents), each once (`pagedkv.interceptors`): it binds the request id, node and
epoch into structlog's context for the duration of the call, times it for the latency
histogram, and turns an escaping exception into a status via `status.status_for` —
domain errors keep their message (clipped by `status.clip`: messages echo client ids, and a
detail beyond the peer's metadata limit would reach it as RESOURCE_EXHAUSTED), anything else
becomes INTERNAL with a generic message while the exception is logged with its traceback.
Requests whose bytes do not parse arrive as `pagedkv.rpc.Undecodable` and are answered
INVALID_ARGUMENT. Handlers never call `context.abort`
for domain errors themselves, so the mapping cannot drift between RPCs.

Credentials, deadlines and per-peer limits are checked before this, by the edge guard
(`pagedkv.guard.EdgeGuard` with the rules of `access.py`), which answers its own refusals.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import structlog

from block_manager.core.errors import InvalidRequest
from block_manager.service.metrics import ServiceMetrics
from block_manager.service.status import clip, status_for
from pagedkv.interceptors import Handler, WrapOnceInterceptor, short_name
from pagedkv.logging import get_logger
from pagedkv.rpc import Undecodable, run_stream

log = get_logger(__name__)

ADMIN_SERVICE = "pagedkv.v1.BlockManagerAdmin"
_CONTEXT_FIELDS = ("request_id", "node_id", "epoch")

_LOG_ID_CHARS = 160


def _log_value(value: Any) -> Any:
    """Request fields bound into every log line of the call, clipped (a client may send a
    20 000-character id)."""
    return clip(value, _LOG_ID_CHARS) if isinstance(value, str) else value


class ErrorMappingInterceptor(WrapOnceInterceptor):
    def __init__(self, metrics: ServiceMetrics | None = None) -> None:
        super().__init__("/pagedkv.", wrap_streams=True)   # the data plane and the admin service
        self._metrics = metrics

    def wrap_unary(self, behavior: Handler, method: str) -> Handler:
        metrics = self._metrics
        method = short_name(method)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            ctx = {f: _log_value(getattr(request, f)) for f in _CONTEXT_FIELDS if getattr(request, f, None)}
            session = getattr(request, "session", None)
            if session is not None and session.session_id:   # sessioned: the number is the key
                ctx["session"] = f"{_log_value(session.session_id)}#{session.seq}"
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            with structlog.contextvars.bound_contextvars(rpc=method, **ctx):
                try:
                    if isinstance(request, Undecodable):
                        raise InvalidRequest(f"malformed request: {request.error}")
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    code = context.code() or grpc.StatusCode.UNKNOWN
                    raise
                except Exception as exc:  # noqa: BLE001 - the single mapping point
                    mapped = status_for(exc)
                    if mapped is None:   # `abort` raises: the call ends here either way
                        code = grpc.StatusCode.INTERNAL
                        log.exception("internal error")
                        await context.abort(code, "internal error")
                    else:
                        code = mapped
                        detail = clip(str(exc) or type(exc).__name__)
                        log.info("rpc failed", code=mapped.name, error=detail, error_type=type(exc).__name__)
                        await context.abort(mapped, detail)
                finally:
                    if metrics is not None:
                        metrics.observe_rpc(method, code.name, time.perf_counter() - t0)

        return call

    def wrap_stream(self, behavior: Any, method: str) -> Any:
        """The same mapping for a server-streaming call (SubscribeKvEvents): an error before or
        between messages ends the stream with its status; the latency histogram is not fed
        (a stream's duration is its subscriber's, not the server's)."""
        method = short_name(method)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> None:
            with structlog.contextvars.bound_contextvars(rpc=method):
                try:
                    if isinstance(request, Undecodable):
                        raise InvalidRequest(f"malformed request: {request.error}")
                    await run_stream(behavior, request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the single mapping point
                    mapped = status_for(exc)
                    if mapped is None:   # `abort` raises: the stream ends here either way
                        log.exception("internal error")
                        await context.abort(grpc.StatusCode.INTERNAL, "internal error")
                    else:
                        detail = clip(str(exc) or type(exc).__name__)
                        log.info("rpc failed", code=mapped.name, error=detail, error_type=type(exc).__name__)
                        await context.abort(mapped, detail)

        return call


__all__ = ["ADMIN_SERVICE", "ErrorMappingInterceptor"]
