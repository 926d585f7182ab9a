"""Retry policy and call statistics shared by the sync and async clients.

Only UNAVAILABLE and DEADLINE_EXCEEDED are retried: those are the codes where the caller
cannot know whether the server acted. Because every mutating request carries a request id
that is generated once per *logical* call and resent verbatim, a retry of an operation the
server already applied returns the recorded result instead of acting twice. Every other
code is a definite answer and is raised at once.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from dataclasses import dataclass, field

import grpc

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def new_request_id() -> str:
    """A fresh id for one logical mutating call (reused verbatim by its retries)."""
    return uuid.uuid4().hex


def request_id_or_new(request_id: str | None) -> str:
    """The caller's id verbatim (even an invalid one: the server judges it), else a new one."""
    return new_request_id() if request_id is None else request_id


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
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return base * (1.0 - self.jitter * rng.random())

    def should_retry(self, code: grpc.StatusCode | None, attempt: int) -> bool:
        return code in RETRYABLE_CODES and attempt < self.max_attempts


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(slots=True)
class ClientStats:
    """What the client sent: `rpcs` counts attempts (retries included), `retries` only the
    repeated ones; `deferred_tokens` counts appends the step helper answered locally."""

    rpcs: int = 0
    retries: int = 0
    errors: int = 0
    deferred_tokens: int = 0
    per_method: Counter[str] = field(default_factory=Counter)

    def record_attempt(self, method: str, retry: bool) -> None:
        self.rpcs += 1
        self.per_method[method] += 1
        if retry:
            self.retries += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "rpcs": self.rpcs,
            "retries": self.retries,
            "errors": self.errors,
            "deferred_tokens": self.deferred_tokens,
            "per_method": dict(sorted(self.per_method.items())),
        }


__all__ = ["NO_RETRY", "RETRYABLE_CODES", "ClientStats", "RetryPolicy", "new_request_id", "request_id_or_new"]
