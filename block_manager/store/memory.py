"""`memory://`: the in-process, non-durable store.

For the in-memory mode of the service and as the baseline of the benchmarks. It keeps the
exact semantics of the durable backends (seq_no assignment, request-id uniqueness,
snapshot pruning, the stored text's round-trip of payloads and results) so the service behaves the same
whichever store it runs on; only durability is missing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from block_manager.store.base import StoreOptions, StoreStats, prune_bounds
from block_manager.store.errors import DuplicateRequestId, InvalidSnapshot, StoreError
from block_manager.store.records import (
    EncodedRecord,
    JournalRecord,
    NewRecord,
    Recovered,
    RetainedRequest,
    canonical_json,
    check_records_after_args,
    check_request_id,
    decode_body,
    decode_json,
    encode_records,
)
from block_manager.store.snapshot import check_snapshot_seq_no


class MemoryStore:
    backend = "memory"

    def __init__(self, options: StoreOptions | None = None) -> None:
        self._options = options or StoreOptions()
        self._lock = threading.Lock()
        # seq_no -> (record, created_at); dicts keep insertion (= seq_no) order.
        self._journal: dict[int, tuple[EncodedRecord, float]] = {}
        self._seq_no_by_request_id: dict[str, int] = {}
        self._snapshot: str | None = None
        self._snapshot_seq_no = 0
        self._last_seq_no = 0
        self._closed = False

    @property
    def last_seq_no(self) -> int:
        return self._last_seq_no

    def recover(self) -> Recovered:
        with self._lock:
            self._check_open()
            records = [
                _to_journal_record(seq_no, rec, created_at)
                for seq_no, (rec, created_at) in self._journal.items()
                if seq_no > self._snapshot_seq_no
            ]
            snapshot = None if self._snapshot is None else decode_json(self._snapshot)
            return Recovered(snapshot, self._snapshot_seq_no, records)

    def append(self, records: Sequence[NewRecord]) -> list[int]:
        encoded = encode_records(records)
        with self._lock:
            self._check_open()
            for rec in encoded:
                if rec.request_id in self._seq_no_by_request_id:
                    raise DuplicateRequestId(f"request id {rec.request_id!r} already journaled")
            now = float(self._options.clock())
            seq_nos: list[int] = []
            for rec in encoded:
                self._last_seq_no += 1
                self._journal[self._last_seq_no] = (rec, now)
                self._seq_no_by_request_id[rec.request_id] = self._last_seq_no
                seq_nos.append(self._last_seq_no)
            return seq_nos

    def write_snapshot(self, seq_no: int, state: dict) -> None:
        if not isinstance(state, dict):
            raise InvalidSnapshot(f"snapshot state must be a dict, got {type(state).__name__}")
        text = canonical_json(state)
        with self._lock:
            self._check_open()
            check_snapshot_seq_no(seq_no, self._snapshot_seq_no, self._last_seq_no)
            self._snapshot = text
            self._snapshot_seq_no = seq_no
            covered, by_count, min_created = prune_bounds(
                seq_no, self._last_seq_no, float(self._options.clock()), self._options
            )
            doomed = [
                s
                for s, (_, created_at) in self._journal.items()
                if s <= covered and (s <= by_count or created_at < min_created)
            ]
            for s in doomed:
                rec, _ = self._journal.pop(s)
                del self._seq_no_by_request_id[rec.request_id]

    def lookup_request(self, request_id: str) -> JournalRecord | None:
        check_request_id(request_id)
        with self._lock:
            self._check_open()
            seq_no = self._seq_no_by_request_id.get(request_id)
            if seq_no is None:
                return None
            rec, created_at = self._journal[seq_no]
            return _to_journal_record(seq_no, rec, created_at)

    def retained_requests(self) -> list[RetainedRequest]:
        with self._lock:
            self._check_open()
            return [
                RetainedRequest(seq_no, rec.request_id, rec.payload_digest)
                for seq_no, (rec, _) in self._journal.items()
            ]

    def records_after(self, seq_no: int, limit: int = 1000) -> list[JournalRecord]:
        check_records_after_args(seq_no, limit)
        with self._lock:
            self._check_open()
            out: list[JournalRecord] = []
            for s, (rec, created_at) in self._journal.items():
                if s > seq_no:
                    out.append(_to_journal_record(s, rec, created_at))
                    if len(out) == limit:
                        break
            return out

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self.backend, self._last_seq_no, self._snapshot_seq_no, len(self._journal)
            )

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")


def _to_journal_record(seq_no: int, rec: EncodedRecord, created_at: float) -> JournalRecord:
    return JournalRecord(
        seq_no=seq_no,
        request_id=rec.request_id,
        op=rec.op,
        payload=decode_body(rec.payload),
        result=decode_body(rec.result),
        payload_digest=rec.payload_digest,
        created_at=created_at,
    )
