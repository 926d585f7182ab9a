"""Alembic environment: migrate the connection the caller passed in (never a URL of its own).

The caller (`block_manager.store.migrate`) holds the store's lock and an open transaction, so
on PostgreSQL a failed migration rolls back as a whole (transactional DDL) and nothing else
writes meanwhile.
"""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("pagedkv migrations run only through block_manager.store.migrate")

context.configure(connection=connection, target_metadata=None, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
