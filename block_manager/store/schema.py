"""SQL schema of the journal store (SQLAlchemy Core; SQLite and PostgreSQL).

Payloads and results are canonical JSON in TEXT columns rather than a JSON column type: the
bytes are produced once by our own encoder, compared by digest, and read back verbatim, and
TEXT behaves identically on both databases.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Double,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    func,
    inspect,
    select,
)

from block_manager.store.errors import SchemaVersionError
from block_manager.store.records import MAX_DIGEST_LEN, MAX_OP_LEN, MAX_REQUEST_ID_LEN

SCHEMA_VERSION = 1

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


def ensure_schema(conn: Connection) -> None:
    """Create the tables if missing and check the schema version; call inside a transaction.

    A database written by a newer version (or one holding our tables but no version row)
    raises `SchemaVersionError` before anything is created or changed.
    """
    if inspect(conn).has_table("meta"):
        value = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        if value is not None:
            _check_version(value)
            metadata.create_all(conn, checkfirst=True)
            return
    metadata.create_all(conn, checkfirst=True)
    num_rows = conn.execute(select(func.count()).select_from(journal)).scalar_one()
    num_rows += conn.execute(select(func.count()).select_from(snapshots)).scalar_one()
    if num_rows:
        raise SchemaVersionError("database holds journal data but no schema version")
    conn.execute(meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))


def _check_version(value: str) -> None:
    try:
        version = int(value)
    except ValueError:
        raise SchemaVersionError(f"unreadable schema version {value!r}") from None
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"database schema version {version} is newer than this code supports "
            f"({SCHEMA_VERSION}); upgrade pagedkv"
        )
    if version < SCHEMA_VERSION:
        raise SchemaVersionError(
            f"database schema version {version} is older than {SCHEMA_VERSION} and no "
            "migration exists"
        )
