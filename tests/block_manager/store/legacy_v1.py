"""A database exactly as the block manager wrote it before schema migrations (not a test module).

Frozen copy of the `ensure_schema` of that version (tables + `meta.schema_version = 1`, no
`alembic_version`) and of its row format, so the migration tests upgrade what real
deployments hold. Records are written with the store's own encoders, which did not change.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
)

from block_manager.store import NewRecord
from block_manager.store.records import encode_records
from block_manager.store.snapshot import ENCODING_JSON_ZLIB, encode_snapshot

_SeqNo = BigInteger().with_variant(Integer(), "sqlite")
metadata = MetaData()
journal = Table(
    "journal",
    metadata,
    Column("seq_no", _SeqNo, primary_key=True, autoincrement=False),
    Column("request_id", String(256), nullable=False, unique=True),
    Column("op", String(64), nullable=False),
    Column("payload", Text, nullable=False),
    Column("result", Text, nullable=False),
    Column("payload_digest", String(64), nullable=False),
    Column("created_at", Double, nullable=False),
)
snapshots = Table(
    "snapshots",
    metadata,
    Column("seq_no", _SeqNo, primary_key=True, autoincrement=False),
    Column("encoding", String(16), nullable=False),
    Column("state", LargeBinary, nullable=False),
    Column("created_at", Double, nullable=False),
)
meta = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
)


def write_legacy_database(url: str, records: list[NewRecord], snapshot: tuple[int, dict] | None) -> None:
    """Create the v1 tables at `url` and write `records` (seq_no 1..n) and `snapshot`."""
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            metadata.create_all(conn)
            conn.execute(meta.insert().values(key="schema_version", value="1"))
            rows = [
                {
                    "seq_no": i + 1, "request_id": r.request_id, "op": r.op, "payload": r.payload,
                    "result": r.result, "payload_digest": r.payload_digest, "created_at": 1_000.0 + i,
                }
                for i, r in enumerate(encode_records(records))
            ]
            if rows:
                conn.execute(journal.insert(), rows)
            if snapshot is not None:
                seq_no, state = snapshot
                conn.execute(snapshots.insert().values(
                    seq_no=seq_no, encoding=ENCODING_JSON_ZLIB, state=encode_snapshot(state, 1), created_at=999.0,
                ))
    finally:
        engine.dispose()
