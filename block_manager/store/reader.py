"""`JournalReader`: read a SQL store that another process writes (a standby following its
leader's journal). It takes no lock and writes nothing, so it never competes with the writer;
commits land in seq_no order (one writer, one transaction at a time), so a reader never sees
record N+1 without record N — a gap means a snapshot pruned records it had not read yet.
"""

from __future__ import annotations

from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from block_manager.store.errors import StoreError
from block_manager.store.records import JournalRecord
from block_manager.store.schema import journal, snapshots
from block_manager.store.snapshot import decode_snapshot
from block_manager.store.sql import _row_to_record


class JournalReader:
    def __init__(self, url: str) -> None:
        try:
            parsed = make_url(url)
        except ArgumentError as exc:
            raise StoreError(f"bad store URL {url!r}: {exc}") from exc
        if parsed.drivername in ("postgresql", "postgres"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        self._engine = create_engine(parsed, pool_pre_ping=True, pool_size=1, max_overflow=0)

    def latest_snapshot(self) -> tuple[int, dict] | None:
        """`(seq_no, state)` of the latest snapshot, or None."""
        try:
            with self._engine.connect() as conn:
                row = conn.execute(
                    select(snapshots.c.seq_no, snapshots.c.encoding, snapshots.c.state)
                    .order_by(snapshots.c.seq_no.desc())
                    .limit(1)
                ).first()
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot read the snapshot: {exc.__class__.__name__}") from exc
        return None if row is None else (int(row.seq_no), decode_snapshot(row.encoding, bytes(row.state)))

    def latest_snapshot_seq_no(self) -> int:
        """seq_no of the latest snapshot (0: none), without reading the snapshot."""
        try:
            with self._engine.connect() as conn:
                value = conn.execute(select(snapshots.c.seq_no).order_by(snapshots.c.seq_no.desc()).limit(1)).scalar()
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot read the snapshot position: {exc.__class__.__name__}") from exc
        return int(value or 0)

    def records_after(self, seq_no: int, limit: int) -> list[JournalRecord]:
        try:
            with self._engine.connect() as conn:
                rows = conn.execute(
                    select(journal).where(journal.c.seq_no > seq_no).order_by(journal.c.seq_no).limit(limit)
                ).all()
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot read the journal: {exc.__class__.__name__}") from exc
        return [_row_to_record(r) for r in rows]

    def close(self) -> None:
        self._engine.dispose()


__all__ = ["JournalReader"]
