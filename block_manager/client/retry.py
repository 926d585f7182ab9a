"""Call statistics of the block manager clients; the retry discipline itself (code set, backoff,
loop) is the project-wide one in `pagedkv.rpc`, re-exported here for the client's users."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagedkv.rpc import NO_RETRY, RETRYABLE_CODES, RetryPolicy, new_request_id, request_id_or_new


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
        """Count one attempt of `method` (a retry when `retry`)."""
        self.rpcs += 1
        self.per_method[method] += 1
        if retry:
            self.retries += 1

    def as_dict(self) -> dict[str, object]:
        """The counters as plain values (for reports and JSON)."""
        return {
            "rpcs": self.rpcs,
            "retries": self.retries,
            "errors": self.errors,
            "deferred_tokens": self.deferred_tokens,
            "per_method": dict(sorted(self.per_method.items())),
        }


__all__ = ["NO_RETRY", "RETRYABLE_CODES", "ClientStats", "RetryPolicy", "new_request_id", "request_id_or_new"]
