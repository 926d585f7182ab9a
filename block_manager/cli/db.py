"""`block-manager db`: the store's schema revision, upgrades and downgrades (Alembic).

    block-manager db current  [--database-url URL | --config FILE]
    block-manager db upgrade  [--revision REV]      # default: head
    block-manager db downgrade REVISION             # "base" drops every table (asks --yes)
    block-manager db history

The URL comes from `--database-url`, else the serve config (`--config`, `PAGEDKV_*`
environment), exactly as `block-manager serve` finds it. `upgrade`/`downgrade` take the
store's single-writer lock first: on SQLite they refuse while a block manager has the file
open; on PostgreSQL while a leader serves it (stop it, or start the new version with
`serve --migrate`, which migrates once it holds the lock). Exit codes: 0 done, 1 refused or
failed (one line on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from block_manager.store import StoreError, StoreOptions
from block_manager.store import migrate as migrations
from block_manager.store.backends import connect_locked, parse_store_url
from block_manager.store.locks import release_pg_advisory_lock
from pagedkv.cli import ArgumentParser
from pagedkv.settings import ConfigError

EXIT_ERROR = 1
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_ERROR) -> int:
    print(f"block-manager db: error: {message}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="block-manager db", description="Schema revisions of the block manager's store."
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("current", "print the database's schema revision and the head this code needs"),
        ("upgrade", "upgrade the database's schema (default: to head)"),
        ("downgrade", "downgrade the database's schema to REVISION"),
        ("history", "list the known revisions, oldest first"),
    ):
        p = sub.add_parser(name, help=help_text)
        if name == "history":
            continue
        p.add_argument("--database-url", help="store URL (default: from --config / PAGEDKV_DATABASE_URL)")
        p.add_argument("--config", type=Path, help="the serve YAML config file to read database_url from")
        p.add_argument("--lock-wait", type=float, default=0.0, help="seconds to wait for the store's lock")
        if name == "upgrade":
            p.add_argument("--revision", default="head", help="target revision (default: head)")
        if name == "downgrade":
            p.add_argument("revision", help='target revision, or "base" (drops every table and record)')
            p.add_argument("--yes", action="store_true", help='confirm a downgrade to "base"')
    return parser


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return str(args.database_url)
    from block_manager.service.config import load_config

    return load_config(args.config).database_url


def _missing_sqlite_file(url: URL) -> Path | None:
    """The SQLite file `url` names when it does not exist (reading or downgrading it would only
    create an empty one), else None."""
    if url.get_backend_name() != "sqlite":
        return None
    path = Path(url.database or "").expanduser()
    return None if path.exists() else path


def _current(parsed: URL) -> int:
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    engine = create_engine(parsed)
    try:
        with engine.connect() as conn, conn.begin():
            state = migrations.schema_state(conn)
    finally:
        engine.dispose()
    current = state.current or "none (empty database)"
    legacy = " (written before migrations: not stamped yet)" if state.legacy else ""
    status = "up to date" if state.is_current else "needs: block-manager db upgrade"
    print(f"current: {current}{legacy}\nhead:    {state.head}\nstatus:  {status}")
    return 0


def _migrate(url: str, args: argparse.Namespace) -> int:
    if args.action == "downgrade" and args.revision == "base" and not args.yes:
        return _fail('a downgrade to "base" drops every table and record; pass --yes to confirm', EXIT_USAGE)
    backend, engine, writer, release = connect_locked(url, StoreOptions(lock_wait_s=args.lock_wait))
    try:
        with writer.begin():
            before = migrations.schema_state(writer)
            if args.action == "upgrade":
                after = migrations.upgrade(writer, args.revision)
            else:
                after = migrations.downgrade(writer, args.revision)
    finally:
        if backend == "postgresql":
            release_pg_advisory_lock(writer)
        writer.close()
        engine.dispose()
        release()
    print(f"{args.action}: {before.current or 'none'} -> {after.current or 'none'} (head {after.head})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "history":
        for rev in migrations.known_revisions():
            print(rev)
        return 0
    try:
        url = _database_url(args)
        try:
            parsed = parse_store_url(url)
        except StoreError as exc:             # a URL no store can have
            return _fail(str(exc), EXIT_USAGE)
        if parsed is None:
            return _fail("memory:// has no schema", EXIT_USAGE)
        missing = None if args.action == "upgrade" else _missing_sqlite_file(parsed)
        if missing is not None:
            return _fail(f"no database at {missing} (`block-manager serve` or `block-manager db upgrade` creates one)")
        if args.action == "current":
            return _current(parsed)
        return _migrate(url, args)
    except StoreError as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except SQLAlchemyError as exc:
        return _fail(f"database error: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    except ConfigError as exc:  # --config's file or the environment: the caller's to fix
        return _fail(str(exc), EXIT_USAGE)
    except ValueError as exc:  # bad revisions
        return _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 - alembic's CommandError etc.: one line, no traceback
        if type(exc).__module__.startswith("alembic"):
            return _fail(str(exc))
        raise


if __name__ == "__main__":
    sys.exit(main())
