"""Baseline: the schema every block manager wrote before migrations existed.

journal (one row per mutating RPC), snapshots (the latest service state), meta (the
`schema_version` row, still kept so binaries from before migrations refuse a newer database).
A database written by those binaries has exactly these tables and `schema_version = 1`; it
is recognised as this revision without running anything (see `migrate.current_revision`).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# The column sizes of block_manager.store.records at the time of this revision (frozen here:
# a migration must not change when the application's constants do).
_MAX_REQUEST_ID_LEN = 256
_MAX_OP_LEN = 64
_MAX_DIGEST_LEN = 64
_SeqNo = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "journal",
        sa.Column("seq_no", _SeqNo, primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.String(_MAX_REQUEST_ID_LEN), nullable=False, unique=True),
        sa.Column("op", sa.String(_MAX_OP_LEN), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("payload_digest", sa.String(_MAX_DIGEST_LEN), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_table(
        "snapshots",
        sa.Column("seq_no", _SeqNo, primary_key=True, autoincrement=False),
        sa.Column("encoding", sa.String(16), nullable=False),
        sa.Column("state", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    meta = op.create_table(
        "meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
    )
    op.bulk_insert(meta, [{"key": "schema_version", "value": "1"}])


def downgrade() -> None:
    op.drop_table("meta")
    op.drop_table("snapshots")
    op.drop_table("journal")
