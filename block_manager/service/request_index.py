"""In-memory index of recent request ids: digest always, result while it fits.

Idempotency needs, for every request id a client may still retry, the digest of the
original request (to detect reuse with another payload) and its result (to answer the
retry). Digests are small, so the index keeps one for each of the last
`max_requests` mutations — the same window the durable store retains. Results can be
large (an AppendSlots result carries a slot per sequence), so they are kept only for the
most recent `max_result_items` outcome items; an older retry fetches its result from the
store (`JournalRecord.result`) or, without a durable store, is refused as expired rather
than executed twice.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Recorded:
    digest: str
    result: dict[str, Any] | None         # None: evicted from memory (ask the store)
    committed: asyncio.Future[int] | None  # None: known committed (replayed / looked up)


def result_weight(result: dict[str, Any]) -> int:
    """Rough size of a result in outcome items (batched results dominate)."""
    weight = 1
    for value in result.values():
        if isinstance(value, (list, tuple)):
            weight += len(value)
    return weight


class RequestIndex:
    def __init__(self, max_requests: int, max_result_items: int) -> None:
        self.max_requests = max_requests
        self.max_result_items = max_result_items
        self._entries: OrderedDict[str, Recorded] = OrderedDict()
        self._with_results: deque[tuple[str, int]] = deque()
        self._result_items = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> Recorded | None:
        return self._entries.get(request_id)

    def put(self, request_id: str, entry: Recorded) -> None:
        entries = self._entries
        entries[request_id] = entry
        entries.move_to_end(request_id)
        while len(entries) > self.max_requests:
            entries.popitem(last=False)
        if entry.result is not None:
            weight = result_weight(entry.result)
            self._with_results.append((request_id, weight))
            self._result_items += weight
            self._shed_results()

    def _shed_results(self) -> None:
        while self._result_items > self.max_result_items and len(self._with_results) > 1:
            request_id, weight = self._with_results.popleft()
            self._result_items -= weight
            old = self._entries.get(request_id)
            if old is None:
                continue  # already evicted by count
            if old.committed is not None and not old.committed.done():
                # still in flight: its concurrent retries need the result; keep it
                self._with_results.appendleft((request_id, weight))
                self._result_items += weight
                return
            old.result = None

__all__ = ["Recorded", "RequestIndex", "result_weight"]
