"""Request ids: the index of the ones the server must still recognise, and the namespace of
the server's own.

Idempotency needs, for every request id a client may still retry, the digest of the
original request (to detect reuse with another payload) and its result (to answer the
retry). Which ids those are depends on the store:

- with a journal, the index holds at least every id the journal holds. The journal's
  request id is unique, and the service applies an op to its in-memory state *before* it
  journals it, so an id evicted from memory but still journaled would be applied a second
  time and then refused by the store — after the state already changed, i.e. fatally. So
  entries are never evicted by count here; they are forgotten only when a snapshot lets the
  store prune them (`forget_through`, called with a bound no larger than the store's own);
- without one (`memory://`), the newest `max_requests` ids are kept, the same window a
  durable store would retain.

Digests are small; results can be large (an AppendSlots result carries a slot per sequence),
so results are kept only for the most recent `max_result_items` outcome items. An older
retry reads its result back from the journal (`JournalRecord.result`) or, when the journal
no longer has it, is refused as expired rather than executed twice.

Internal ids: the server journals its own decisions (lease expiry, defrag plans and their
timeouts) through the same path as client requests, keyed by request id. Their ids start with
a control character, which `protocol.check_request_id` (1..128 printable ASCII) never
accepts, so no client can pre-empt or collide with one (see `internal_request_id`).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from block_manager.store.records import MAX_DIGEST_LEN, MAX_REQUEST_ID_LEN, Body, Packed

INTERNAL_MARK = "\x1f"   # ASCII unit separator: starts and separates the parts of an internal id
HASHED_MARK = "\x1e"     # ASCII record separator: starts an internal id too long to keep verbatim
_KIND = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_READABLE_PREFIX = 64


def _hashed(text: str) -> str:
    return HASHED_MARK + text[:_READABLE_PREFIX] + HASHED_MARK + hashlib.sha256(text.encode()).hexdigest()


def internal_request_id(kind: str, *parts: object) -> str:
    """The request id of one of the server's own mutations, e.g. `("expire", node_id, epoch)`.

    Deterministic (a retry of the same decision maps to the same id, so it is journaled once),
    outside the client namespace (it starts with a control character), and at most
    `MAX_REQUEST_ID_LEN` characters whatever the parts: an id that would be longer keeps a
    readable prefix and the sha256 of the whole text. `kind` is a lower-case word; parts may
    be anything printable (client ids and pool ids included).
    """
    if not _KIND.match(kind):
        raise ValueError(f"internal request id kind must match {_KIND.pattern}, got {kind!r}")
    texts = [str(p) for p in parts]
    for text in texts:
        if not text.isprintable():
            raise ValueError(f"internal request id parts must be printable, got {text!r}")
    return _fit(INTERNAL_MARK + INTERNAL_MARK.join([kind, *texts]))


def as_internal_request_id(request_id: str) -> str:
    """`request_id` moved into the internal namespace (unchanged when it already is there)."""
    if is_internal_request_id(request_id):
        return _fit(request_id)
    return _fit(INTERNAL_MARK + request_id)


def _fit(request_id: str) -> str:
    return request_id if len(request_id) <= MAX_REQUEST_ID_LEN else _hashed(request_id)


def is_internal_request_id(request_id: str) -> bool:
    return request_id[:1] in (INTERNAL_MARK, HASHED_MARK)


def message_body(request: Any) -> bytes:
    """A request message's deterministic encoding without its `request_id` and `session` (a
    resend may carry a newer ack; the session number is the key, not the content): what its
    digest is taken over, and for a Step what the journal stores (`ReceivedStep.body`)."""
    rid = request.request_id
    session = None
    if request.HasField("session"):
        session = type(request.session)()
        session.CopyFrom(request.session)
        request.ClearField("session")
    request.request_id = ""
    try:
        return bytes(request.SerializeToString(deterministic=True))
    finally:
        request.request_id = rid
        if session is not None:
            request.session.CopyFrom(session)


def body_digest(method: str, body: bytes) -> str:
    """sha256 of `method` + a request's `message_body`: what a retry is compared against."""
    return hashlib.sha256(method.encode() + b"\0" + body).hexdigest()


def fit_digest(digest: str) -> str:
    """A digest the journal's column holds: longer ones (a caller's composite digest) are
    replaced by their sha256. Digests are only ever compared for equality, so this keeps
    every comparison's outcome."""
    if len(digest) <= MAX_DIGEST_LEN:
        return digest
    return hashlib.sha256(digest.encode()).hexdigest()


@dataclass(slots=True)
class Recorded:
    digest: str
    result: Body | None                   # None: evicted from memory (ask the store)
    committed: asyncio.Future[int] | None  # None: known committed (replayed / looked up)
    seq_no: int = 0                        # journal position; 0 while not yet committed


def result_weight(result: Body) -> int:
    """Rough size of a result in outcome items (batched results dominate; a packed one counts
    an item per 8 bytes, about what a packed column entry takes)."""
    if isinstance(result, Packed):
        return 1 + len(result.data) // 8
    weight = 1
    for value in result.values():
        if isinstance(value, (list, tuple)):
            weight += len(value)
    return weight


class RequestIndex:
    def __init__(self, max_requests: int, max_result_items: int, *, durable: bool = False) -> None:
        self.max_requests = max_requests
        self.max_result_items = max_result_items
        # durable: entries leave only through `forget_through` (see the module docstring).
        self.durable = durable
        self._entries: OrderedDict[str, Recorded] = OrderedDict()
        self._with_results: deque[tuple[str, Recorded, int]] = deque()
        self._result_items = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> Recorded | None:
        return self._entries.get(request_id)

    def put(self, request_id: str, entry: Recorded) -> None:
        entries = self._entries
        entries[request_id] = entry
        entries.move_to_end(request_id)
        if not self.durable:
            while len(entries) > self.max_requests:
                entries.popitem(last=False)
        if entry.result is not None:
            weight = result_weight(entry.result)
            self._with_results.append((request_id, entry, weight))
            self._result_items += weight
            self._shed_results()

    def forget_through(self, seq_no: int) -> int:
        """Forget committed entries with a journal position <= `seq_no` (the store has pruned
        them or may now do so); entries are in journal order, so this pops from the front
        and stops at the first newer or still uncommitted one. Returns how many went."""
        entries = self._entries
        forgotten = 0
        while entries:
            request_id, entry = next(iter(entries.items()))
            if entry.seq_no == 0 or entry.seq_no > seq_no:
                break
            del entries[request_id]
            forgotten += 1
        return forgotten

    def _shed_results(self) -> None:
        while self._result_items > self.max_result_items and len(self._with_results) > 1:
            request_id, entry, weight = self._with_results.popleft()
            if self._entries.get(request_id) is not entry:
                self._result_items -= weight  # already forgotten (or its id reused since)
                continue
            if entry.committed is not None and not entry.committed.done():
                # still in flight: its concurrent retries need the result; keep it
                self._with_results.appendleft((request_id, entry, weight))
                return
            self._result_items -= weight
            entry.result = None


__all__ = [
    "HASHED_MARK",
    "INTERNAL_MARK",
    "Recorded",
    "RequestIndex",
    "as_internal_request_id",
    "fit_digest",
    "internal_request_id",
    "is_internal_request_id",
    "result_weight",
]
