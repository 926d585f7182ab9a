"""Call discipline shared by every gRPC client and server of the project.

Clients: one code set, one backoff rule, one loop (sync and asyncio flavours): the block
manager's data and admin clients and the compute node's link to the block manager all retry the
same way. Only UNAVAILABLE and DEADLINE_EXCEEDED are retried: those are the codes where the
caller cannot know whether the server acted. Every mutating request carries a request id
generated once per *logical* call and resent verbatim, so a retry of an operation the server
already applied returns the recorded result instead of acting twice. Every other code is a
definite answer. Loops that retry until they succeed (a node registering with a block manager
that is down) use `Backoff`: capped and jittered, so a fleet does not hammer a server that is
coming back, nor flood its own log.

Servers (both services' error-mapping interceptors): a request whose bytes do not parse reaches
the handler as `Undecodable` (gRPC would otherwise answer UNKNOWN with the parser's class name),
and every status detail goes through `clip`, because details echo client values (ids) and a
detail longer than the peer's metadata limit turns any status into RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

# Codes after which a call's outcome is unknown and the same call may succeed later. CANCELLED
# is one: these clients never cancel a unary call themselves, so it is the server stopping
# mid-call (a block manager shut down without grace, or past it), which may or may not have
# applied the call; the request id makes the retry safe.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.CANCELLED})

T = TypeVar("T")


def answered_plain_http(details: str | None) -> bool:
    """Whether a failed call's details say the port answered HTTP/1.x, not gRPC (the OpenAI
    server's port given where a gRPC service's belongs: a slip worth naming)."""
    return "http1.x server" in (details or "")


def new_request_id() -> str:
    """A fresh id for one logical mutating call (reused verbatim by its retries)."""
    return uuid.uuid4().hex


def request_id_or_new(request_id: str | None) -> str:
    """The caller's id verbatim (even an invalid one: the server judges it), else a new one."""
    return new_request_id() if request_id is None else request_id


def is_retryable(code: grpc.StatusCode | None) -> bool:
    """Whether the same call may succeed later and might not have been applied."""
    return code in RETRYABLE_CODES


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter.

    Attempt `k` (k = 1 for the first retry) sleeps `min(max_backoff_s, initial_backoff_s *
    multiplier**(k-1))` scaled by a uniform factor in `[1 - jitter, 1]`, so a crowd of
    clients that lost the same server does not come back in lockstep.
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `retry` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return base * (1.0 - self.jitter * rng.random())

    def should_retry(self, code: grpc.StatusCode | None, attempt: int) -> bool:
        """Whether attempt number `attempt` (1-based), which failed with `code`, gets another."""
        return is_retryable(code) and attempt < self.max_attempts


NO_RETRY = RetryPolicy(max_attempts=1)


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    rng: random.Random,
    on_attempt: Callable[[bool], None] | None = None,
) -> T:
    """Call `fn()` until it returns, raises a definite `grpc.RpcError`, or attempts run out.
    `on_attempt(is_retry)` is told of every attempt (call statistics)."""
    attempt = 0
    while True:
        attempt += 1
        if on_attempt is not None:
            on_attempt(attempt > 1)
        try:
            return fn()
        except grpc.RpcError as exc:
            if not policy.should_retry(exc.code(), attempt):
                raise
        time.sleep(policy.backoff_s(attempt, rng))


async def acall_with_retry(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    rng: random.Random,
    on_attempt: Callable[[bool], None] | None = None,
) -> T:
    """`call_with_retry` for asyncio stubs: `fn()` returns the call's awaitable."""
    attempt = 0
    while True:
        attempt += 1
        if on_attempt is not None:
            on_attempt(attempt > 1)
        try:
            return await fn()
        except grpc.RpcError as exc:
            if not policy.should_retry(exc.code(), attempt):
                raise
        await asyncio.sleep(policy.backoff_s(attempt, rng))


@dataclass(slots=True)
class Backoff:
    """Delays for a loop that retries until it succeeds (no attempt limit).

    After failure `k` (1-based) the delay is `min(max_s, initial_s * multiplier**(k-1))`
    scaled by a uniform factor in `[1 - jitter, 1]`: it grows to the cap and stays there, and
    a fleet restarted together spreads out. `reset()` after a success starts again at
    `initial_s`. The exponent stops growing once the cap is reached, so the loop may run
    forever without overflowing. Pass a seeded `rng` to make the delays reproducible.
    """

    initial_s: float = 0.5
    max_s: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0
    _base_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.multiplier < 1:
            raise ValueError("Backoff needs 0 < initial_s <= max_s and multiplier >= 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def next_delay(self) -> float:
        """Record one more failure; seconds to wait before the next attempt."""
        self.failures += 1
        if self.failures == 1:
            self._base_s = self.initial_s
        elif self._base_s < self.max_s:
            self._base_s = min(self.max_s, self._base_s * self.multiplier)
        return self._base_s * (1.0 - self.jitter * self.rng.random())

    def reset(self) -> None:
        """The operation succeeded: the next failure waits `initial_s` again."""
        self.failures = 0
        self._base_s = 0.0


# ---- the server edge --------------------------------------------------------------------
MAX_DETAIL_CHARS = 1024


def clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` cut to at most `limit` characters: its start and its end, with the middle
    replaced by a note of the full length (messages usually end with what went wrong).

    For anything that echoes a client's value back (status details, per-item error messages,
    log fields): a 20 000-character node id must come back as a short INVALID_ARGUMENT or
    NOT_FOUND, not as RESOURCE_EXHAUSTED "metadata size exceeds hard limit" from the transport.
    """
    if len(text) <= limit:
        return text
    note = f" ...[{len(text)} chars]... "
    keep = limit - len(note)
    if keep < 2:
        return text[: max(0, limit)]
    head = keep * 2 // 3
    return text[:head] + note + text[len(text) - (keep - head) :]


class Undecodable:
    """Stands in for a request whose bytes do not parse, so the handler wrapper can answer
    INVALID_ARGUMENT (grpc itself would answer UNKNOWN from inside its deserializer, naming
    the parser's exception class)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def tolerant_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, returning `Undecodable` instead of raising on malformed bytes."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return Undecodable(clip(str(exc), 200) or "cannot parse the request")

    return parse


Behavior = Callable[[Any, Any], Awaitable[Any]]


def wrap_unary_handler(
    handler: grpc.RpcMethodHandler | None, fn: Callable[[Behavior], Behavior], *, tolerant: bool = False
) -> grpc.RpcMethodHandler | None:
    """A unary-unary handler whose behaviour is `fn(original behaviour)`; with `tolerant`, its
    requests are parsed by `tolerant_deserializer`. Other handler kinds pass through."""
    if handler is None or handler.unary_unary is None:
        return handler
    deserializer = handler.request_deserializer
    return grpc.unary_unary_rpc_method_handler(
        fn(handler.unary_unary),
        request_deserializer=tolerant_deserializer(deserializer) if tolerant else deserializer,
        response_serializer=handler.response_serializer,
    )


def wrap_unary_stream_handler(
    handler: grpc.RpcMethodHandler | None, fn: Callable[[Any], Any], *, tolerant: bool = False
) -> grpc.RpcMethodHandler | None:
    """A unary-stream (server-streaming) handler whose behaviour is `fn(original behaviour)`;
    with `tolerant`, requests are parsed by `tolerant_deserializer`. Its responses may also be
    `bytes` already serialized (sent as they are: a stream that sends one message to many
    peers serializes it once). Other handler kinds pass through."""
    if handler is None or handler.unary_stream is None:
        return handler
    deserializer = handler.request_deserializer
    return grpc.unary_stream_rpc_method_handler(
        fn(handler.unary_stream),
        request_deserializer=tolerant_deserializer(deserializer) if tolerant else deserializer,
        response_serializer=_bytes_or(handler.response_serializer),
    )


def _bytes_or(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    if serializer is None or getattr(serializer, "passes_bytes", False):
        return serializer

    def serialize(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serializer(message)

    serialize.passes_bytes = True  # type: ignore[attr-defined]  # a marker on the function, read by getattr above
    return serialize



async def run_stream(behavior: Any, request: Any, context: Any) -> None:
    """Run a server-streaming handler of either style — an async generator (each item is
    written) or a coroutine that writes itself — so a wrapper can present one style to gRPC."""
    result = behavior(request, context)
    if inspect.isasyncgen(result):
        async for item in result:
            await context.write(item)
    else:
        await result


__all__ = [
    "answered_plain_http",
    "MAX_DETAIL_CHARS",
    "NO_RETRY",
    "RETRYABLE_CODES",
    "Backoff",
    "RetryPolicy",
    "Undecodable",
    "acall_with_retry",
    "call_with_retry",
    "clip",
    "is_retryable",
    "new_request_id",
    "run_stream",
    "request_id_or_new",
    "tolerant_deserializer",
    "wrap_unary_handler",
    "wrap_unary_stream_handler",
]
