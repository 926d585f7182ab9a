"""Alembic migrations of the journal store's SQL schema (SQLite and PostgreSQL).

Run by `block_manager.store.migrate` (the server's start-up check and `block-manager db ...`);
`env.py` only runs on a connection handed over in `config.attributes["connection"]`, so a
migration always happens inside the caller's transaction and under its lock.
"""
