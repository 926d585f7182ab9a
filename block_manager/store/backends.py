"""Opening a store from a URL: `sqlite:///…`, `postgresql+psycopg://…`, `memory://`.

SQLite durability (`synchronous`): in WAL mode, FULL fsyncs the WAL file on every commit,
so an acknowledged mutation survives a power loss or kernel crash; NORMAL fsyncs only at
checkpoints, so a commit survives a process crash (SIGKILL) but the last commits may be lost
on power loss. The block manager acknowledges a mutation only after `append` returns and
promises it is durable, so FULL is the default. Measured with `bench/bench_store.py` on
the 2-core dev VM (p50 commit latency, one record per transaction): 1-sequence record
0.74 ms FULL vs 0.18 ms NORMAL; a columnar 256-sequence AppendSlots record 1.0 ms vs
0.45 ms. That is one fsync per commit, and group commit shares it between every RPC of a
batch (16 records in one transaction: 1.2 ms FULL), so FULL stays inside a scheduler step.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from block_manager.store.base import StoreOptions
from block_manager.store.errors import SchemaOutdated, StoreError
from block_manager.store.locks import FileLock, acquire_pg_advisory_lock
from block_manager.store.memory import MemoryStore
from block_manager.store.sql import SqlStore


def open_store(url: str, options: StoreOptions | None = None) -> MemoryStore | SqlStore:
    """Open (creating if needed) the store at `url` and take its single-writer lock.

    Raises `StoreLocked` if another block manager holds the database, `SchemaVersionError`
    if it was written by a newer schema, `SchemaOutdated` (naming the `block-manager db
    upgrade` command to run) if by an older one and `options.migrate` is off, `StoreError`
    for a bad URL or unreachable database.
    """
    options = options or StoreOptions()
    parsed = parse_store_url(url)
    if parsed is None:
        return MemoryStore(options)
    try:
        if parsed.get_backend_name() == "sqlite":
            return _open_sqlite(parsed, options)
        return _open_postgres(parsed, options)
    except SchemaOutdated as exc:
        raise exc.with_command(upgrade_command(parsed)) from None


def parse_store_url(url: str) -> URL | None:
    """`url` parsed (None for `memory://`); `StoreError` for a malformed URL, a scheme no store
    has, or an SQLite URL without a file. Opens nothing: the service's config checks its URL
    with it, so a typo is a usage error before anything starts or logs."""
    if url in ("memory://", "memory:"):
        return None
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"bad store URL {url!r}: {exc}") from exc
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql", "postgres"):
        raise StoreError(f"unsupported store URL scheme {parsed.drivername!r} (sqlite, postgresql, memory)")
    if backend == "sqlite" and (not parsed.database or parsed.database == ":memory:"):
        raise StoreError("an SQLite store needs a file path, sqlite:///FILE (use memory:// for no durability)")
    return parsed


def upgrade_command(url: URL) -> str:
    """The exact command that upgrades the database at `url` (password masked)."""
    shown = url.render_as_string(hide_password=True)
    return f"block-manager db upgrade --database-url {shlex.quote(shown)}"


def connect_locked(url: str, options: StoreOptions | None = None) -> tuple[str, Engine, Connection, Callable[[], None]]:
    """Connect to an SQL store and take its single-writer lock, without touching the schema.

    Returns `(backend, engine, writer, release_lock)`; the caller owns all three (the
    `block-manager db` commands migrate through `writer`; `open_store` builds a `SqlStore`).
    """
    options = options or StoreOptions()
    parsed = parse_store_url(url)
    if parsed is None:
        raise StoreError(f"{url!r} is not an SQL store (sqlite, postgresql)")
    if parsed.get_backend_name() == "sqlite":
        return ("sqlite", *_connect_sqlite(parsed, options))
    return ("postgresql", *_connect_postgres(parsed, options))


def _open_sqlite(url: URL, options: StoreOptions) -> SqlStore:
    engine, writer, release = _connect_sqlite(url, options)
    try:
        return SqlStore("sqlite", engine, writer, options, release)
    except BaseException as exc:
        writer.close()
        engine.dispose()
        release()
        if isinstance(exc, SQLAlchemyError):
            raise StoreError(f"cannot open SQLite store {url.database}: {exc}") from exc
        raise


def _connect_sqlite(url: URL, options: StoreOptions) -> tuple[Engine, Connection, Callable[[], None]]:
    path = Path(url.database or "").expanduser().resolve()     # a file: parse_store_url checked
    # A missing directory is refused, not created: it is far more often a typo or a volume that
    # is not mounted (the journal would then live, and vanish, inside the container).
    if not path.parent.is_dir():
        raise StoreError(
            f"cannot open SQLite store {path}: directory {path.parent} does not exist (create it first)"
        )
    lock = FileLock(path.with_name(path.name + ".lock"), options.lock_wait_s)
    try:
        engine = create_engine(url.set(drivername="sqlite+pysqlite", database=str(path)))

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            mode = cur.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"SQLite refused WAL mode (got {mode!r})")
            cur.execute(f"PRAGMA synchronous={options.sqlite_synchronous}")
            cur.execute(f"PRAGMA busy_timeout={int(options.sqlite_busy_timeout_ms)}")
            cur.close()

        writer = engine.connect()
    except SQLAlchemyError as exc:
        lock.release()
        raise StoreError(f"cannot open SQLite store {path}: {exc}") from exc
    return engine, writer, lock.release


def _open_postgres(url: URL, options: StoreOptions) -> SqlStore:
    engine, writer, release = _connect_postgres(url, options)
    try:
        # Closing the writer ends the session, which releases the advisory lock.
        return SqlStore("postgresql", engine, writer, options, release)
    except SQLAlchemyError as exc:
        writer.close()
        engine.dispose()
        raise StoreError(f"cannot open PostgreSQL store: {exc}") from exc
    except BaseException:
        writer.close()
        engine.dispose()
        raise


def _connect_postgres(url: URL, options: StoreOptions) -> tuple[Engine, Connection, Callable[[], None]]:
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    try:
        engine = create_engine(url, pool_pre_ping=True)
        writer = engine.connect()
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot connect to PostgreSQL store: {exc}") from exc
    try:
        with writer.begin():
            # Durable on commit even if the server default was relaxed.
            writer.execute(text("SET synchronous_commit = on"))
        acquire_pg_advisory_lock(writer, options.lock_wait_s)
        if options.leader_lease_s is not None:
            # The fence: once this session is silent for a lease the server ends it, the lock
            # goes with it, and no statement of ours can commit any more.
            lease_ms = max(1, int(options.leader_lease_s * 1000))
            with writer.begin():
                writer.execute(text(f"SET idle_session_timeout = {lease_ms}"))
                writer.execute(text(f"SET idle_in_transaction_session_timeout = {lease_ms}"))
    except SQLAlchemyError as exc:
        writer.close()
        engine.dispose()
        raise StoreError(f"cannot open PostgreSQL store: {exc}") from exc
    except BaseException:
        writer.close()
        engine.dispose()
        raise
    return engine, writer, lambda: None
