"""Schema revisions of the journal store: read, check, upgrade, downgrade (Alembic).

Every function runs on a connection the caller already holds, inside its transaction and
under its single-writer lock (the store's writer at start-up, `block-manager db ...` from
the command line), so a migration never races a serving block manager on the same database.
On PostgreSQL the DDL is transactional (a failed upgrade leaves the old schema intact) and a
transaction-scoped advisory lock serialises two processes that migrate at once.

The revision of a database:
- the `alembic_version` row when there is one;
- `0001` (the baseline) for a database written before migrations existed: it has our tables
  and `meta.schema_version = 1` and no `alembic_version`; upgrading stamps it first, so its
  records are never touched by a CREATE;
- None for a database without our tables (a fresh one: the server creates it at head).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

# Alembic's own INFO lines are noise in a service log and in a user's script that builds an
# `LLM` (our events say what happened): "Context impl ..." at each migration, and, since
# Alembic 1.18, one "setup plugin ..." line per built-in plugin while `alembic.command` is
# imported, below. So the level is set before that import.
logging.getLogger("alembic").setLevel(logging.WARNING)

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from sqlalchemy import Connection, inspect, select, text  # noqa: E402

from block_manager.store.errors import SchemaOutdated, SchemaVersionError  # noqa: E402
from block_manager.store.schema import SCHEMA_VERSION, meta  # noqa: E402
from pagedkv.logging import get_logger  # noqa: E402

log = get_logger(__name__)

BASELINE = "0001"
_MIGRATIONS_DIR = Path(__file__).with_name("migrations")
# Serialises migrations of one PostgreSQL database (a different key from the leader lock).
PG_MIGRATION_LOCK_KEY = int.from_bytes(
    hashlib.sha256(b"pagedkv.block_manager.store.migrate").digest()[:8], "big", signed=True
)


@dataclass(slots=True, frozen=True)
class SchemaState:
    current: str | None  # None: no tables of ours yet
    head: str
    legacy: bool  # written before migrations (no alembic_version row yet)

    @property
    def is_current(self) -> bool:
        return self.current == self.head


def _config(conn: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS_DIR))
    cfg.attributes["connection"] = conn
    return cfg


def _script() -> ScriptDirectory:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS_DIR))
    return ScriptDirectory.from_config(cfg)


def head_revision() -> str:
    head = _script().get_current_head()
    if head is None:  # pragma: no cover - the package ships its revisions
        raise SchemaVersionError("no schema migrations are installed")
    return head


def known_revisions() -> list[str]:
    """Every revision, oldest first."""
    return [rev.revision for rev in reversed(list(_script().walk_revisions()))]


def schema_state(conn: Connection) -> SchemaState:
    """Where the database stands; raises `SchemaVersionError` for a database this code
    cannot place (newer revision, tables without a version)."""
    head = head_revision()
    insp = inspect(conn)
    meta_version = None
    if insp.has_table("meta"):
        meta_version = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        if meta_version is not None:
            _check_not_newer(meta_version)
    if insp.has_table("alembic_version"):
        current = MigrationContext.configure(conn).get_current_revision()
        if current is not None and current not in known_revisions():
            raise SchemaVersionError(
                f"database schema revision {current} is newer than this code knows (head {head}); upgrade pagedkv"
            )
        if current is not None:
            return SchemaState(current, head, legacy=False)
    if meta_version is not None:
        if meta_version != "1":
            raise SchemaVersionError(f"database says schema_version {meta_version} but has no revision row")
        return SchemaState(BASELINE, head, legacy=True)
    if insp.has_table("journal") or insp.has_table("snapshots"):
        raise SchemaVersionError("database holds journal tables but no schema version")
    return SchemaState(None, head, legacy=False)


def _check_not_newer(value: str) -> None:
    try:
        version = int(value)
    except ValueError:
        raise SchemaVersionError(f"unreadable schema version {value!r}") from None
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"database schema version {version} is newer than this code supports ({SCHEMA_VERSION}); upgrade pagedkv"
        )


def _lock(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK_KEY})


def upgrade(conn: Connection, target: str = "head") -> SchemaState:
    """Upgrade to `target` (inside the caller's transaction); returns the new state."""
    _lock(conn)
    state = schema_state(conn)
    cfg = _config(conn)
    if state.legacy:
        command.stamp(cfg, BASELINE)
    command.upgrade(cfg, target)
    after = schema_state(conn)
    if after.current != state.current:
        log.warning("schema upgraded", backend=conn.dialect.name, before=state.current, after=after.current)
    return after


def downgrade(conn: Connection, target: str) -> SchemaState:
    """Downgrade to `target` (a revision, or "base": drops every table and record)."""
    _lock(conn)
    state = schema_state(conn)
    if state.current is None:
        raise SchemaVersionError("the database has no schema to downgrade")
    cfg = _config(conn)
    if state.legacy:
        command.stamp(cfg, BASELINE)
    command.downgrade(cfg, target)
    after = schema_state(conn)
    log.warning("schema downgraded", backend=conn.dialect.name, before=state.current, after=after.current)
    return after


def check_schema(conn: Connection, migrate: bool) -> SchemaState:
    """The server's start-up check: a fresh database is created at head; an older one is
    upgraded only when `migrate`, else `SchemaOutdated` says what to run; nothing changes
    on a refusal."""
    _lock(conn)
    state = schema_state(conn)
    if state.is_current:
        return state
    if state.current is not None and not migrate:
        raise SchemaOutdated(state.current, state.head)
    return upgrade(conn)


__all__ = [
    "BASELINE",
    "SchemaState",
    "check_schema",
    "downgrade",
    "head_revision",
    "known_revisions",
    "schema_state",
    "upgrade",
]
