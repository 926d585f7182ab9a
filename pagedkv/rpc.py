"""Client-side call discipline shared by every gRPC client of the project.

One code set, one backoff rule, one loop (sync and asyncio flavours): the block manager's data
and admin clients and the compute node's link to the block manager all retry the same way.

Only UNAVAILABLE and DEADLINE_EXCEEDED are retried: those are the codes where the caller cannot
know whether the server acted. Every mutating request carries a request id generated once per
*logical* call and resent verbatim, so a retry of an operation the server already applied
returns the recorded result instead of acting twice. Every other code is a definite answer.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

T = TypeVar("T")


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
            if not policy.should_retry(exc.code(), attempt):  # type: ignore[attr-defined]
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
            if not policy.should_retry(exc.code(), attempt):  # type: ignore[attr-defined]
                raise
        await asyncio.sleep(policy.backoff_s(attempt, rng))


__all__ = [
    "NO_RETRY",
    "RETRYABLE_CODES",
    "RetryPolicy",
    "acall_with_retry",
    "call_with_retry",
    "is_retryable",
    "new_request_id",
    "request_id_or_new",
]
