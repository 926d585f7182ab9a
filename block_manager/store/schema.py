"""SQL schema of the journal store (SQLAlchemy Core; SQLite and PostgreSQL).

These table objects are what the store's queries use; the database's tables are created and
changed only by the Alembic migrations in `block_manager/store/migrations/` (run by
`block_manager.store.migrate`), and `SCHEMA_VERSION` is the `meta.schema_version` the newest
migration writes. A change here needs a new migration (tests/block_manager/store/
test_store_migrations.py checks that the migrated database matches these tables).

Payloads and results are canonical JSON in TEXT columns rather than a JSON column type: the
bytes are produced once by our own encoder, compared by digest, and read back verbatim, and
TEXT behaves identically on both databases.
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
)

from block_manager.store.records import MAX_DIGEST_LEN, MAX_OP_LEN, MAX_REQUEST_ID_LEN

SCHEMA_VERSION = 2

# On SQLite an INTEGER PRIMARY KEY is the rowid itself (no second index to maintain).
_SeqNo = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

journal = Table(
    "journal",
    metadata,
    Column("seq_no", _SeqNo, primary_key=True, autoincrement=False),
    Column("request_id", String(MAX_REQUEST_ID_LEN), nullable=False, unique=True),
    Column("op", String(MAX_OP_LEN), nullable=False),
    Column("payload", Text, nullable=False),
    Column("result", Text, nullable=False),
    Column("payload_digest", String(MAX_DIGEST_LEN), nullable=False),
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

leadership = Table(
    "leadership",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("epoch", BigInteger, nullable=False),
    Column("holder", String(256), nullable=False),
    Column("acquired_at", Double, nullable=False),
)
