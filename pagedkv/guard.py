"""The edge guard: the first interceptor of both services. Before a call reaches a handler
(and so before anything can change) it

1. refuses a call whose deadline has already passed (DEADLINE_EXCEEDED): a request that sat
   in a queue longer than its caller waits is not applied behind the caller's back. Later,
   gRPC AsyncIO cancels a running handler when its deadline passes (at its next `await`), so a
   mutation still waiting (the journal's gate, a request-id lookup) is not applied either;
   one already applied is journaled and its retry gets the recorded result;
2. authenticates the caller (`pagedkv.auth.Authenticator`: bearer token or client
   certificate) and asks the service's `authorize(method, principal, request)` rule whether
   that principal may make this call with this request (a node only for its own node id, ...):
   UNAUTHENTICATED for missing or invalid credentials, PERMISSION_DENIED for valid ones that
   are not allowed;
3. caps the calls in flight per peer (`max_inflight_per_peer`; the peer is the authenticated
   principal, else the client's IP address): RESOURCE_EXHAUSTED beyond it, so one client
   cannot tie up every worker of the server (HTTP/2's `max_concurrent_streams` caps one
   connection; this caps a peer across all its connections).

Only the service's own methods (`/pagedkv.*`) are guarded: health and reflection stay open to
any peer that completed the transport handshake (orchestrators probe them; with mutual TLS the
handshake already demands a certificate from the CA). A refused call is logged with the
method, the peer and the reason, and reported to `on_refused` (metrics).

The error-mapping interceptor of each service stays the one place where domain errors become
statuses; this guard answers only for the edge's own refusals.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from pagedkv.auth import Authenticator, Principal, Refusal
from pagedkv.interceptors import Handler, WrapOnceInterceptor
from pagedkv.logging import get_logger
from pagedkv.rpc import clip, run_stream

log = get_logger(__name__)

Authorize = Callable[[str, Principal, Any], str | None]


def peer_host(peer: str) -> str:
    """`ipv4:10.0.0.5:51234` -> `ipv4:10.0.0.5`, `ipv6:[::1]:5` -> `ipv6:[::1]` (one key per client
    host, whatever the connection)."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class EdgeGuard(WrapOnceInterceptor):
    def __init__(
        self,
        *,
        authenticator: Authenticator | None = None,
        authorize: Authorize | None = None,
        guarded: Callable[[str], bool] | None = None,
        max_inflight_per_peer: int | None = None,
        on_refused: Callable[[str, grpc.StatusCode, float], None] | None = None,
        prefix: str = "/pagedkv.",
    ) -> None:
        """`authenticator` None: no identity checks. `guarded(method)`: whether `method` needs
        credentials (default: every method of ours). `authorize(method, principal, request)`
        returns why the principal may not make the call, or None."""
        super().__init__(prefix, wrap_streams=True, tolerant=False)   # the error mapping parses tolerantly
        self._auth = authenticator
        self._authorize = authorize
        self._guarded = guarded or (lambda _method: True)
        self._cap = max_inflight_per_peer
        self._on_refused = on_refused
        self._inflight: dict[str, int] = {}

    @property
    def inflight(self) -> dict[str, int]:
        return dict(self._inflight)

    def wrap_unary(self, behavior: Handler, method: str) -> Handler:
        needs_auth = self._auth is not None and self._guarded(method)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            key = await self._admit(request, context, method, needs_auth)
            if key is None:
                return await behavior(request, context)
            try:
                return await behavior(request, context)
            finally:
                self._leave(key)

        return call

    def wrap_stream(self, behavior: Any, method: str) -> Any:
        """A server-streaming call passes the same checks before its first message; it counts
        as one call in flight for as long as it stays open. Either handler style works (an
        async generator, or a coroutine that writes with `context.write`)."""
        needs_auth = self._auth is not None and self._guarded(method)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> None:
            key = await self._admit(request, context, method, needs_auth)
            try:
                await run_stream(behavior, request, context)
            finally:
                if key is not None:
                    self._leave(key)

        return call

    async def _admit(
        self, request: Any, context: grpc.aio.ServicerContext, method: str, needs_auth: bool
    ) -> str | None:
        """Deadline, identity, rule, then the per-peer cap (aborts the call on a refusal);
        the in-flight key taken (release it with `_leave`), None when nothing is capped."""
        t0 = time.perf_counter()
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await self._refuse(context, method, t0, None, Refusal(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before the server could start it"))
        principal: Principal | None = None
        if needs_auth and self._auth is not None:
            found = self._auth.identify(context)
            if isinstance(found, Refusal):
                await self._refuse(context, method, t0, None, found)
            principal = found
            why = self._authorize(method, principal, request) if self._authorize is not None else None
            if why is not None:
                await self._refuse(context, method, t0, principal, Refusal(grpc.StatusCode.PERMISSION_DENIED, why))
        cap = self._cap
        if cap is None:
            return None
        key = str(principal) if principal is not None else peer_host(context.peer())
        n = self._inflight.get(key, 0)
        if n >= cap:
            await self._refuse(context, method, t0, principal, Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many calls in flight from this peer (limit {cap})"))
        self._inflight[key] = n + 1
        return key

    def _leave(self, key: str) -> None:
        left = self._inflight[key] - 1
        if left:
            self._inflight[key] = left
        else:
            del self._inflight[key]

    async def _refuse(
        self, context: grpc.aio.ServicerContext, method: str, t0: float, principal: Principal | None, refusal: Refusal
    ) -> NoReturn:
        log.warning(
            "call refused", rpc=method.rsplit("/", 1)[-1], code=refusal.code.name, reason=clip(refusal.message, 300),
            peer=context.peer(), principal=str(principal) if principal is not None else None,
        )
        if self._on_refused is not None:
            self._on_refused(method.rsplit("/", 1)[-1], refusal.code, time.perf_counter() - t0)
        await context.abort(refusal.code, clip(refusal.message))
        raise RuntimeError("the servicer context's abort returned")   # grpc's raises AbortError


__all__ = ["Authorize", "EdgeGuard", "peer_host"]
