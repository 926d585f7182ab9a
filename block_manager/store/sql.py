"""`SqlStore`: the journal store over SQLAlchemy Core (SQLite or PostgreSQL).

All writes go through ONE dedicated writer connection, serialised by a thread lock: the
block manager has a single writer by design (group commit batches concurrent RPCs into one
`append`), and on PostgreSQL that connection is the one holding the advisory lock. Reads for
`lookup_request` use the engine's pool so a retry lookup never waits behind a commit.

seq_nos are assigned here, not by the database: the single-writer lock makes an in-process
counter safe, and it lets `append` insert a whole batch in one `executemany` without a
round trip per row to learn ids. The counter only advances after a commit succeeds.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from sqlalchemy import Connection, Engine, delete, func, or_, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from block_manager.store.base import StoreOptions, StoreStats, prune_bounds
from block_manager.store.errors import DuplicateRequestId, InvalidRecord, StoreError
from block_manager.store.locks import release_pg_advisory_lock
from block_manager.store.migrate import check_schema
from block_manager.store.records import (
    JournalRecord,
    NewRecord,
    Recovered,
    RetainedRequest,
    check_records_after_args,
    check_request_id,
    decode_body,
    encode_records,
)
from block_manager.store.schema import journal, leadership, snapshots
from block_manager.store.snapshot import (
    ENCODING_JSON_ZLIB,
    check_snapshot_seq_no,
    decode_snapshot,
    encode_snapshot,
)


class SqlStore:
    def __init__(
        self,
        backend: str,
        engine: Engine,
        writer: Connection,
        options: StoreOptions,
        release_lock: Callable[[], None],
    ) -> None:
        """Take over an engine and a writer connection that already holds the lock.

        Use `open_store`; on failure here the caller releases the lock.
        """
        self.backend = backend
        self._engine = engine
        self._writer = writer
        self._options = options
        self._release_lock = release_lock
        self._write_lock = threading.Lock()
        self._broken: str | None = None
        self._closed = False
        self._stop_keepalive = threading.Event()
        holder = options.holder or f"{socket.gethostname()}:{os.getpid()}"
        with self._writer.begin():
            self.schema = check_schema(self._writer, options.migrate)
            # A new leadership term: numbered in the database, under the lock, before serving.
            self.epoch = int(self._writer.execute(
                update(leadership).where(leadership.c.id == 1)
                .values(epoch=leadership.c.epoch + 1, holder=holder[:256], acquired_at=float(options.clock()))
                .returning(leadership.c.epoch)
            ).scalar_one())
            last_journal = self._writer.execute(select(func.max(journal.c.seq_no))).scalar()
            last_snapshot = self._writer.execute(select(func.max(snapshots.c.seq_no))).scalar()
        self._snapshot_seq_no = int(last_snapshot or 0)
        self._last_seq_no = max(int(last_journal or 0), self._snapshot_seq_no)
        self._alive_at = time.monotonic()
        self._insert = _JournalInsert(writer)

    @property
    def last_seq_no(self) -> int:
        return self._last_seq_no

    def recover(self) -> Recovered:
        with self._write_lock:
            self._check_usable()
            with self._guard("recover"), self._writer.begin():
                row = self._writer.execute(
                    select(snapshots.c.seq_no, snapshots.c.encoding, snapshots.c.state)
                    .order_by(snapshots.c.seq_no.desc())
                    .limit(1)
                ).first()
                snapshot_seq_no = 0 if row is None else int(row.seq_no)
                rows = self._writer.execute(
                    select(journal)
                    .where(journal.c.seq_no > snapshot_seq_no)
                    .order_by(journal.c.seq_no)
                ).all()
            snapshot = None if row is None else decode_snapshot(row.encoding, bytes(row.state))
            return Recovered(snapshot, snapshot_seq_no, [_row_to_record(r) for r in rows])

    def append(self, records: Sequence[NewRecord]) -> list[int]:
        encoded = encode_records(records)
        if not encoded:
            return []
        with self._write_lock:
            self._check_usable()
            now = float(self._options.clock())
            first = self._last_seq_no + 1
            rows = [
                (first + i, rec.request_id, rec.op, rec.payload, rec.result, rec.payload_digest, now)
                for i, rec in enumerate(encoded)
            ]
            try:
                with self._guard("append"), self._writer.begin():
                    self._insert.run(self._writer, rows)
            except IntegrityError as exc:
                raise DuplicateRequestId(
                    "a request id of this batch is already journaled; nothing was written"
                ) from exc
            self._last_seq_no += len(rows)
            self._alive_at = time.monotonic()
            return list(range(first, first + len(rows)))

    def write_snapshot(self, seq_no: int, state: dict) -> None:
        blob = encode_snapshot(state, self._options.snapshot_compress_level)
        with self._write_lock:
            self._check_usable()
            check_snapshot_seq_no(seq_no, self._snapshot_seq_no, self._last_seq_no)
            now = float(self._options.clock())
            covered, by_count, min_created = prune_bounds(
                seq_no, self._last_seq_no, now, self._options
            )
            with self._guard("write_snapshot"), self._writer.begin():
                self._writer.execute(delete(snapshots))
                self._writer.execute(
                    snapshots.insert().values(
                        seq_no=seq_no, encoding=ENCODING_JSON_ZLIB, state=blob, created_at=now
                    )
                )
                self._writer.execute(
                    delete(journal).where(
                        journal.c.seq_no <= covered,
                        or_(journal.c.seq_no <= by_count, journal.c.created_at < min_created),
                    )
                )
            self._snapshot_seq_no = seq_no

    def lookup_request(self, request_id: str) -> JournalRecord | None:
        check_request_id(request_id)
        self._check_usable()
        with self._guard("lookup_request"), self._engine.connect() as conn:
            row = conn.execute(select(journal).where(journal.c.request_id == request_id)).first()
        return None if row is None else _row_to_record(row)

    def retained_requests(self) -> list[RetainedRequest]:
        self._check_usable()
        with self._guard("retained_requests"), self._engine.connect() as conn:
            rows = conn.execute(
                select(journal.c.seq_no, journal.c.request_id, journal.c.payload_digest).order_by(journal.c.seq_no)
            ).all()
        return [RetainedRequest(int(r.seq_no), r.request_id, r.payload_digest) for r in rows]

    def records_after(self, seq_no: int, limit: int = 1000) -> list[JournalRecord]:
        check_records_after_args(seq_no, limit)
        self._check_usable()
        with self._guard("records_after"), self._engine.connect() as conn:
            rows = conn.execute(
                select(journal)
                .where(journal.c.seq_no > seq_no)
                .order_by(journal.c.seq_no)
                .limit(limit)
            ).all()
        return [_row_to_record(r) for r in rows]

    def stats(self) -> StoreStats:
        self._check_usable()
        with self._guard("stats"), self._engine.connect() as conn:
            count = conn.execute(select(func.count()).select_from(journal)).scalar_one()
        return StoreStats(self.backend, self._last_seq_no, self._snapshot_seq_no, int(count))

    # ---- leadership lease (PostgreSQL active/standby) ------------------------------------
    def start_keepalive(self, on_lost: Callable[[BaseException], None]) -> None:
        """Ping the lock-holding session every lease/4 so the server never ends it while we
        are healthy; on the first failure the store turns unusable and `on_lost(exc)` is
        called (from the keepalive thread). No-op without `leader_lease_s`."""
        lease = self._options.leader_lease_s
        if lease is None:
            return
        thread = threading.Thread(
            target=self._keepalive_loop, args=(lease / 4, on_lost), name="store-keepalive", daemon=True
        )
        thread.start()

    def _keepalive_loop(self, interval_s: float, on_lost: Callable[[BaseException], None]) -> None:
        while not self._stop_keepalive.wait(interval_s):
            try:
                with self._write_lock:
                    if self._closed:
                        return
                    self._check_usable()
                    with self._guard("keepalive"), self._writer.begin():
                        self._writer.execute(text("SELECT 1"))
                    self._alive_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any failure ends the term
                self._broken = self._broken or "keepalive"
                on_lost(exc)
                return

    def leadership_fresh(self) -> bool:
        """True while the database cannot have ended our session: the last statement that
        succeeded on it is younger than 0.8 x the lease (the server ends it only after a
        full lease of silence). A process paused past its lease finds this False at once on
        waking, before any answer leaves it. Always True without a lease."""
        lease = self._options.leader_lease_s
        if lease is None:
            return self._broken is None
        return self._broken is None and time.monotonic() - self._alive_at < 0.8 * lease

    def close(self) -> None:
        self._stop_keepalive.set()
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.backend == "postgresql" and self._broken is None:
                    release_pg_advisory_lock(self._writer)
                self._writer.close()
                self._engine.dispose()
            finally:
                self._release_lock()

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreError("store is closed")
        if self._broken is not None:
            raise StoreError(f"store is unusable after a failed {self._broken}; reopen it")

    def _guard(self, what: str) -> _DbErrors:
        return _DbErrors(self, what)


class _JournalInsert:
    """The journal INSERT, compiled once for the writer's dialect and run as driver SQL.

    `append` is the one statement on the commit path; going through `journal.insert()` each
    time costs a cache-key walk, a compiled-cache lookup and per-row parameter processing —
    about as much CPU as SQLite's own insert of a step's record (bench/bench_store.py
    `--cpu`). The statement text is the one SQLAlchemy compiles, so types and quoting are
    the dialect's; errors still pass through SQLAlchemy (IntegrityError on a duplicate id).
    """

    __slots__ = ("_keys", "_sql")

    COLUMNS = ("seq_no", "request_id", "op", "payload", "result", "payload_digest", "created_at")

    def __init__(self, conn: Connection) -> None:
        compiled = journal.insert().compile(dialect=conn.dialect, column_keys=list(self.COLUMNS))
        self._sql = str(compiled)
        # Positional paramstyles (SQLite's qmark) take tuples in the compiled order; named
        # ones (psycopg's pyformat) take dicts.
        self._keys = None if compiled.positional else self.COLUMNS
        if compiled.positional and tuple(compiled.positiontup or ()) != self.COLUMNS:
            raise StoreError(f"unexpected journal insert parameter order: {compiled.positiontup}")

    def run(self, conn: Connection, rows: list[tuple[Any, ...]]) -> None:
        if self._keys is None:
            conn.exec_driver_sql(self._sql, rows)
        else:
            conn.exec_driver_sql(self._sql, [dict(zip(self._keys, row, strict=True)) for row in rows])


class _DbErrors:
    """Turn database errors into `StoreError`.

    A failed write leaves the caller's in-memory state ahead of the journal (and on
    PostgreSQL may mean the lock-holding session is gone), so the store refuses further
    use: the service must stop and recover rather than keep acknowledging.
    """

    __slots__ = ("_store", "_what")

    def __init__(self, store: SqlStore, what: str) -> None:
        self._store = store
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> Literal[False]:
        if exc is None or isinstance(exc, IntegrityError):
            return False
        if isinstance(exc, SQLAlchemyError):
            if self._what in ("append", "write_snapshot", "recover") or (
                isinstance(exc, DBAPIError) and exc.connection_invalidated
            ):
                self._store._broken = self._what
            raise StoreError(f"{self._what} failed: {exc.__class__.__name__}: {exc}") from exc
        return False


def _row_to_record(row: Any) -> JournalRecord:
    try:
        payload, result = decode_body(row.payload), decode_body(row.result)
    except InvalidRecord as exc:
        raise StoreError(f"journal record {row.seq_no} is unreadable: {exc}") from exc
    return JournalRecord(
        seq_no=int(row.seq_no),
        request_id=row.request_id,
        op=row.op,
        payload=payload,
        result=result,
        payload_digest=row.payload_digest,
        created_at=float(row.created_at),
    )
