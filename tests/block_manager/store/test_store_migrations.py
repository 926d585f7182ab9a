"""Alembic schema migrations: a database written before migrations existed (today's main) is
upgraded with every record kept, on SQLite and on a real PostgreSQL server; an older schema
is refused at start-up with the exact command to run, or upgraded with --migrate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from legacy_v1 import write_legacy_database
from sqlalchemy import create_engine, inspect, text
from store_helpers import make_record

from block_manager.cli import db as db_cli
from block_manager.store import SchemaOutdated, StoreOptions, canonical_json, open_store
from block_manager.store import migrate as migrations
from block_manager.store.schema import SCHEMA_VERSION, metadata

ROOT = Path(__file__).resolve().parents[3]
NUM_RECORDS = 60
SNAPSHOT = (20, {"pools": {"p0": {"num_blocks": 8}}, "note": "legacy snapshot"})


def _engine(url: str):  # type: ignore[no-untyped-def]
    return create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


def _tables(url: str) -> set[str]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def _legacy(url: str) -> list:
    records = [make_record(f"req-{i}", num_seqs=1 + i % 3) for i in range(NUM_RECORDS)]
    write_legacy_database(url, records, SNAPSHOT)
    return records


def _as_stored(value: dict) -> dict:
    return json.loads(canonical_json(value))


def _check_records_kept(url: str, records: list) -> None:
    store = open_store(url)
    try:
        recovered = store.recover()
        assert recovered.snapshot == SNAPSHOT[1]
        assert recovered.snapshot_seq_no == SNAPSHOT[0]
        # Every legacy record survives: those after the snapshot replay, all are answerable.
        assert [r.seq_no for r in recovered.records] == list(range(SNAPSHOT[0] + 1, NUM_RECORDS + 1))
        for rec in records:
            found = store.lookup_request(rec.request_id)
            assert found is not None
            assert (found.op, found.payload, found.result, found.payload_digest) == (
                rec.op, _as_stored(rec.payload), _as_stored(rec.result), rec.payload_digest,
            )
        assert [r.request_id for r in store.retained_requests()] == [r.request_id for r in records]
        # The upgraded store keeps working: seq_nos continue after the legacy ones.
        assert store.append([make_record("after-upgrade")]) == [NUM_RECORDS + 1]
        assert store.schema.current == migrations.head_revision()
    finally:
        store.close()


def test_fresh_database_is_created_at_head_and_matches_the_code(durable_url: str) -> None:
    open_store(durable_url).close()
    engine = _engine(durable_url)
    try:
        with engine.connect() as conn:
            assert migrations.schema_state(conn).is_current
            # The migrations build exactly the tables the store's queries use.
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
            assert diff == [], diff
            assert conn.execute(text("SELECT value FROM meta")).scalar() == str(SCHEMA_VERSION)
    finally:
        engine.dispose()


def test_old_schema_is_refused_with_the_command_to_run_and_left_unchanged(durable_url: str) -> None:
    _legacy(durable_url)
    before = _tables(durable_url)
    with pytest.raises(SchemaOutdated) as info:
        open_store(durable_url)
    message = str(info.value)
    assert "revision 0001" in message and f"needs {migrations.head_revision()}" in message
    assert "block-manager db upgrade --database-url" in message and "--migrate" in message
    assert _tables(durable_url) == before  # nothing created, nothing stamped
    assert "alembic_version" not in before


def test_db_upgrade_keeps_every_record(durable_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    records = _legacy(durable_url)
    assert db_cli.main(["current", "--database-url", durable_url]) == 0
    out = capsys.readouterr().out
    assert "current: 0001 (written before migrations" in out and "needs: block-manager db upgrade" in out
    assert db_cli.main(["upgrade", "--database-url", durable_url]) == 0
    assert f"upgrade: 0001 -> {migrations.head_revision()}" in capsys.readouterr().out
    assert db_cli.main(["current", "--database-url", durable_url]) == 0
    assert "up to date" in capsys.readouterr().out
    _check_records_kept(durable_url, records)


def test_migrate_option_upgrades_at_open(durable_url: str) -> None:
    records = _legacy(durable_url)
    open_store(durable_url, StoreOptions(migrate=True)).close()
    _check_records_kept(durable_url, records)


def test_downgrade_to_baseline_and_back_keeps_records(durable_url: str) -> None:
    records = _legacy(durable_url)
    assert db_cli.main(["upgrade", "--database-url", durable_url]) == 0
    assert db_cli.main(["downgrade", "0001", "--database-url", durable_url]) == 0
    tables = _tables(durable_url)
    assert "leadership" not in tables and {"journal", "snapshots", "meta", "alembic_version"} <= tables
    with pytest.raises(SchemaOutdated):
        open_store(durable_url)
    assert db_cli.main(["upgrade", "--database-url", durable_url]) == 0
    _check_records_kept(durable_url, records)


def test_db_cli_refuses_while_a_block_manager_holds_the_store(durable_url: str, capsys) -> None:  # type: ignore[no-untyped-def]
    store = open_store(durable_url)
    try:
        assert db_cli.main(["upgrade", "--database-url", durable_url]) == 1
        assert "StoreLocked" in capsys.readouterr().err
    finally:
        store.close()
    assert db_cli.main(["downgrade", "base", "--database-url", durable_url]) == 2  # needs --yes
    assert "--yes" in capsys.readouterr().err


def test_unknown_revision_is_one_line_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'j.db'}"
    open_store(url).close()
    assert db_cli.main(["downgrade", "nosuch", "--database-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("block-manager db: error:") and err.count("\n") == 1


def test_reading_or_downgrading_a_missing_sqlite_file_creates_nothing(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`db current` on a mistyped path used to create an empty database and report "none"."""
    url = f"sqlite:///{tmp_path / 'typo.db'}"
    for argv in (["current"], ["downgrade", "0001"]):
        assert db_cli.main([*argv, "--database-url", url]) == 1
        err = capsys.readouterr().err
        assert err.startswith("block-manager db: error: no database at ") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
    assert db_cli.main(["current", "--database-url", "foo://x"]) == 2      # a usage error, said as such
    assert "unsupported store URL scheme 'foo'" in capsys.readouterr().err
    (tmp_path / "bm.yaml").write_text("bogus_key: 1\n")
    assert db_cli.main(["current", "--config", str(tmp_path / "bm.yaml")]) == 2
    assert "invalid configuration: bogus_key" in capsys.readouterr().err


def test_serve_on_old_schema_names_the_command_and_migrate_flag_starts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'legacy.db'}"
    write_legacy_database(url, [], None)  # a real server replays what it finds: no fake records here
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "block_manager.cli.main", "serve", "--listen", "127.0.0.1:0", "--database-url", url]
    refused = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert f"block-manager db upgrade --database-url {url}" in refused.stderr
    port_file = tmp_path / "port"
    proc = subprocess.Popen([*base, "--migrate", "--port-file", str(port_file)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if port_file.exists() and port_file.read_text().strip() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "schema upgraded" in err
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            assert migrations.schema_state(conn).is_current
    finally:
        engine.dispose()


def test_importing_migrations_after_logging_is_configured_prints_nothing() -> None:
    """Alembic logs one INFO line per built-in plugin while `alembic.command` is imported (1.18+):
    with our logging configured first (an `LLM` in a user's script, a server) they reached
    stderr. A fresh interpreter, since this one has imported Alembic already."""
    code = ("from pagedkv.logging import configure_logging\n"
            "configure_logging()\n"
            "import block_manager.store.migrate\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PAGEDKV_LOG_LEVEL": "INFO"}, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == ""
