"""Leadership: the epoch of the active block manager (active/standby on PostgreSQL).

One row (id = 1). The block manager that takes the database's advisory lock bumps `epoch`
in the same session before it serves, so every leadership term has a number that survives
restarts: logs, the admin status and the health detail name it, and an operator can tell
which process acknowledged what. Also used on SQLite (one process, the epoch counts starts).
`meta.schema_version` becomes 2, so binaries from before migrations refuse this database.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    leadership = op.create_table(
        "leadership",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.String(256), nullable=False),
        sa.Column("acquired_at", sa.Double, nullable=False),
    )
    op.bulk_insert(leadership, [{"id": 1, "epoch": 0, "holder": "", "acquired_at": 0.0}])
    op.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def downgrade() -> None:
    op.drop_table("leadership")
    op.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
