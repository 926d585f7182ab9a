"""Journal record types and the codecs of their payload and result columns, shared by every
backend.

A payload or result is one of two forms, told apart by the stored text's first character:

- a dict, stored as canonical JSON (sorted keys, no whitespace, no NaN/Infinity: the encoding
  is a pure function of the content). Every op but a live Step, and every record written
  before Steps were packed; JSON of an object always starts with `{`.
- `Packed`: bytes in a binary format the service names (with its version, e.g.
  `step-request/1`), stored as `packed:<format>:<base64>`. The service packs a Step's request
  and answer this way (its protobuf bytes, `service/step_journal.py`): no dict and no JSON on
  the hot path. The store never looks inside; base64 keeps the column TEXT on both databases,
  so no migration and an older database reads as before.
"""

from __future__ import annotations

import base64
import binascii
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


PACKED_PREFIX = "packed:"
MAX_FORMAT_LEN = 64


@dataclass(slots=True, frozen=True)
class Packed:
    """A payload or result in a binary format of the service's: `format` names it and its
    version (`[a-z0-9/.-]`, no `:`), `data` is opaque to the store."""

    format: str
    data: bytes

    def to_text(self) -> str:
        """The stored text: `packed:<format>:<base64 of data>`."""
        return f"{PACKED_PREFIX}{self.format}:{base64.b64encode(self.data).decode('ascii')}"

    @classmethod
    def from_text(cls, text: str) -> Packed:
        """`InvalidRecord` when `text` is not a packed body."""
        if not text.startswith(PACKED_PREFIX):
            raise InvalidRecord("not a packed body")
        fmt, sep, data = text[len(PACKED_PREFIX):].partition(":")
        if not sep or not fmt:
            raise InvalidRecord("packed body without a format")
        try:
            return cls(fmt, base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise InvalidRecord(f"packed {fmt} body is not base64: {exc}") from None


# What a record's payload or result is: a JSON-shaped dict, or bytes the service packed.
Body = dict[str, Any] | Packed


def encode_body(body: Body) -> str:
    """The stored text of a payload or result; `InvalidRecord` if it cannot be stored."""
    if isinstance(body, Packed):
        if not 0 < len(body.format) <= MAX_FORMAT_LEN or ":" in body.format or not body.format.isascii():
            raise InvalidRecord(f"bad packed format name {body.format[:80]!r}")
        return body.to_text()
    if not isinstance(body, dict):
        raise InvalidRecord(f"payload and result must be dicts or Packed, got {type(body).__name__}")
    return canonical_json(body)


def decode_body(text: str) -> Body:
    """A stored payload or result back: JSON (`{...}`) or packed; `InvalidRecord` when it is
    neither."""
    if text.startswith(PACKED_PREFIX):
        return Packed.from_text(text)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRecord(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRecord("a stored payload or result is not a JSON object")
    return value


@dataclass(slots=True, frozen=True)
class NewRecord:
    """One mutation as the service hands it to the store.

    `payload` must be enough to replay the operation deterministically through the core;
    `result` is the response returned verbatim when the same `request_id` is retried.
    """

    request_id: str
    op: str
    payload: Body
    result: Body
    payload_digest: str
    # `encode_body(payload)` when the caller already encoded it (the service does, before
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

    `payload` and `result` come back decoded (`decode_body`): JSON ones as dicts (tuples
    read back as lists), packed ones as `Packed`, the same on every backend (the memory store
    round-trips through the stored text too).
    """

    seq_no: int
    request_id: str
    op: str
    payload: Body
    result: Body
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
    """A validated `NewRecord` with its payload and result already encoded (done before any
    I/O, so a bad record fails the batch before a transaction starts)."""

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
        if not isinstance(record.payload, dict | Packed) or not isinstance(record.result, dict | Packed):
            raise InvalidRecord("payload and result must be dicts or Packed")
        if record.request_id in seen:
            raise DuplicateRequestId(f"request id {record.request_id!r} repeated in one batch")
        seen.add(record.request_id)
        encoded.append(
            EncodedRecord(
                request_id=record.request_id,
                op=record.op,
                payload=encode_body(record.payload) if record.payload_json is None else record.payload_json,
                result=encode_body(record.result),
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
