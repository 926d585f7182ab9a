"""Journal record types and the canonical JSON codec shared by every backend.

Canonical JSON (sorted keys, no whitespace, no NaN/Infinity) makes the encoding of a
request a pure function of its content. That is what lets the service compare a retried
request with the recorded one by digest, and keeps journal rows small on the hot path
(an AppendSlots batch of 512 sequences is journaled once per scheduler step).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from block_manager.store.errors import DuplicateRequestId, InvalidRecord

MAX_REQUEST_ID_LEN = 256
MAX_OP_LEN = 64
MAX_DIGEST_LEN = 64

_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
)


def canonical_json(obj: Any) -> str:
    """Encode `obj` as canonical, compact JSON; `InvalidRecord` if it is not encodable."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, ValueError) as exc:
        raise InvalidRecord(f"not JSON-serialisable: {exc}") from exc


def payload_digest(payload: Any) -> str:
    """sha256 hex of the canonical JSON of `payload` (the request-id conflict check)."""
    return hashlib.sha256(canonical_json(payload).encode("utf-8")).hexdigest()


def decode_json(text: str | bytes) -> Any:
    return json.loads(text)


@dataclass(slots=True, frozen=True)
class NewRecord:
    """One mutation as the service hands it to the store.

    `payload` must be enough to replay the operation deterministically through the core;
    `result` is the response returned verbatim when the same `request_id` is retried.
    """

    request_id: str
    op: str
    payload: dict
    result: dict
    payload_digest: str
    # `canonical_json(payload)` when the caller already encoded it (the service does, before
    # it applies the op, so that a payload the store cannot hold fails only its request).
    payload_json: str | None = None


@dataclass(slots=True, frozen=True)
class RetainedRequest:
    """A request id the journal still holds (so a retry of it must be answered from the
    journal, never applied again)."""

    seq_no: int
    request_id: str
    payload_digest: str


@dataclass(slots=True, frozen=True)
class JournalRecord:
    """A journaled mutation: a `NewRecord` plus the store-assigned, strictly increasing
    `seq_no`.

    `payload` and `result` come back JSON-decoded, i.e. tuples read back as lists, the
    same on every backend (the memory store round-trips through JSON too).
    """

    seq_no: int
    request_id: str
    op: str
    payload: dict
    result: dict
    payload_digest: str
    created_at: float


@dataclass(slots=True, frozen=True)
class Recovered:
    """What `Store.recover` returns: the latest snapshot (or None) and every journal
    record after it, in `seq_no` order."""

    snapshot: dict | None
    snapshot_seq_no: int
    records: list[JournalRecord]


@dataclass(slots=True, frozen=True)
class EncodedRecord:
    """A validated `NewRecord` with its JSON already encoded (done before any I/O, so a
    bad record fails the batch before a transaction starts)."""

    request_id: str
    op: str
    payload: str
    result: str
    payload_digest: str


def check_record_fields(request_id: str, op: str, payload_digest: str) -> None:
    """`InvalidRecord` unless every store can hold these columns.

    The one definition of what a record's scalar columns may contain, used by `encode_records`
    and — before it applies anything — by the service, so that a request whose id or digest
    no store can hold is refused on its own instead of failing a whole group commit. Column
    limits are the PostgreSQL ones (SQLite enforces none): `VARCHAR(n)` counts characters, and
    no text may contain NUL.
    """
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN or "\0" in request_id:
        raise InvalidRecord(f"request_id must be a string of 1..{MAX_REQUEST_ID_LEN} characters without NUL")
    if not isinstance(op, str) or not 0 < len(op) <= MAX_OP_LEN or "\0" in op:
        raise InvalidRecord(f"op must be a string of 1..{MAX_OP_LEN} characters without NUL")
    if not isinstance(payload_digest, str) or len(payload_digest) > MAX_DIGEST_LEN or "\0" in payload_digest:
        raise InvalidRecord(f"payload_digest must be a string of at most {MAX_DIGEST_LEN} characters without NUL")


def encode_records(records: Sequence[NewRecord]) -> list[EncodedRecord]:
    """Validate and encode a batch; `InvalidRecord` / `DuplicateRequestId` on bad input."""
    encoded: list[EncodedRecord] = []
    seen: set[str] = set()
    for record in records:
        if not isinstance(record, NewRecord):
            raise InvalidRecord(f"expected NewRecord, got {type(record).__name__}")
        check_record_fields(record.request_id, record.op, record.payload_digest)
        if not isinstance(record.payload, dict) or not isinstance(record.result, dict):
            raise InvalidRecord("payload and result must be dicts")
        if record.request_id in seen:
            raise DuplicateRequestId(f"request id {record.request_id!r} repeated in one batch")
        seen.add(record.request_id)
        encoded.append(
            EncodedRecord(
                request_id=record.request_id,
                op=record.op,
                payload=canonical_json(record.payload) if record.payload_json is None else record.payload_json,
                result=canonical_json(record.result),
                payload_digest=record.payload_digest,
            )
        )
    return encoded


def check_records_after_args(seq_no: int, limit: int) -> None:
    for name, value in (("seq_no", seq_no), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRecord(f"{name} must be an int >= 0, got {value!r}")


def check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str):
        raise InvalidRecord(f"request_id must be a string, got {type(request_id).__name__}")
