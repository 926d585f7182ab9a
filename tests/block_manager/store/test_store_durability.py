"""Single-writer locking, schema versioning and crash durability (real subprocesses)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from store_helpers import make_record

from block_manager.store import (
    SchemaVersionError,
    StoreError,
    StoreLocked,
    StoreOptions,
    open_store,
)
from block_manager.store.schema import SCHEMA_VERSION

HERE = Path(__file__).parent
# Child processes' pipes must be closed by the tests themselves, not by the garbage collector.
pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]
REPO = HERE.parents[2]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_second_store_on_same_database_is_locked_out(durable_url: str, opened) -> None:
    first = opened(durable_url)
    with pytest.raises(StoreLocked):
        opened(durable_url)
    first.close()
    second = opened(durable_url)  # the lock goes with close()
    assert second.append([make_record("x")]) == [1]


def test_sqlite_lock_holds_against_another_process(tmp_path: Path, opened) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    opened(url)
    probe = textwrap.dedent(
        f"""
        from block_manager.store import StoreLocked, open_store
        try:
            open_store({url!r})
        except StoreLocked:
            raise SystemExit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=_child_env(), timeout=60)
    assert proc.returncode == 3


def test_sqlite_runs_wal_with_full_sync(tmp_path: Path, opened) -> None:
    for mode, expected in (("FULL", 2), ("NORMAL", 1)):
        store = opened(f"sqlite:///{tmp_path / mode}.db", StoreOptions(sqlite_synchronous=mode))
        with store._writer.begin():
            assert store._writer.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert store._writer.exec_driver_sql("PRAGMA synchronous").scalar() == expected


def test_newer_schema_version_is_a_clear_error(durable_url: str, opened) -> None:
    store = opened(durable_url)
    store.append([make_record("a")])
    store.close()
    engine = create_engine(durable_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE meta SET value = '99' WHERE key = 'schema_version'"))
    with pytest.raises(SchemaVersionError, match="newer"):
        opened(durable_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE meta SET value = :v WHERE key = 'schema_version'"), {"v": str(SCHEMA_VERSION)})
    engine.dispose()
    # The failed open released the lock and changed nothing.
    assert [r.request_id for r in opened(durable_url).recover().records] == ["a"]


@pytest.mark.parametrize(
    "url",
    ["nosuch://x", "sqlite://", "sqlite:///:memory:", "postgresql+psycopg://u@127.0.0.1:1/db", "::"],
)
def test_bad_urls_raise_store_error(url: str) -> None:
    with pytest.raises(StoreError):
        open_store(url)


def test_acknowledged_records_survive_sigkill(durable_url: str, opened) -> None:
    """A writer is SIGKILLed mid-load; everything it acknowledged is there afterwards."""
    acked: dict[str, int] = {}
    last_snap = 0
    for round_no in range(2):  # the second round proves the restarted writer goes on
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "store_writer_child.py"), durable_url],
            stdout=subprocess.PIPE, text=True, env=_child_env(),
        )
        try:
            assert proc.stdout is not None
            ready = proc.stdout.readline().split()
            assert ready[0] == "ready"
            assert int(ready[1]) >= max(acked.values(), default=0)
            n = 0
            while n < 120 + 37 * round_no:  # kill at a different point each round
                kind, *rest = proc.stdout.readline().split()
                if kind == "ack":
                    acked[rest[1]] = int(rest[0])
                    n += 1
                else:
                    last_snap = int(rest[0])
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()   # else the pipe is left to the garbage collector (ResourceWarning)
    assert last_snap > 0
    store = opened(durable_url, StoreOptions(lock_wait_s=10.0))
    recovered = store.recover()
    assert recovered.snapshot == {"upto": recovered.snapshot_seq_no}
    assert recovered.snapshot_seq_no >= last_snap
    replayed = [r.seq_no for r in recovered.records]
    # The snapshot plus the replayed records cover every seq_no without a gap...
    assert replayed == list(range(recovered.snapshot_seq_no + 1, store.last_seq_no + 1))
    assert store.last_seq_no >= max(acked.values())
    # ...and every acknowledged request id is there with its seq_no.
    for request_id, seq_no in acked.items():
        found = store.lookup_request(request_id)
        assert found is not None and found.seq_no == seq_no


def test_postgres_store_fails_closed_when_its_session_dies(fresh_postgres_url: str, opened) -> None:
    """Losing the writer session loses the advisory lock: the store must refuse to write
    from then on (never acknowledge unfenced), and a successor can take over."""
    store = opened(fresh_postgres_url)
    store.append([make_record("before")])
    with store._writer.begin():
        pid = store._writer.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    admin = create_engine(fresh_postgres_url)
    with admin.begin() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
    admin.dispose()
    with pytest.raises(StoreError):
        store.append([make_record("lost")])
    with pytest.raises(StoreError, match="unusable"):
        store.append([make_record("later")])
    successor = opened(fresh_postgres_url, StoreOptions(lock_wait_s=10.0))
    assert [r.request_id for r in successor.recover().records] == ["before"]
    assert successor.append([make_record("after")]) == [2]


@pytest.mark.parametrize(
    ("sql", "what"),
    [
        ("UPDATE snapshots SET state = :junk", "snapshot"),
        ("UPDATE journal SET payload = 'not json' WHERE seq_no = 2", "journal record 2"),
        ("UPDATE journal SET result = '[1]' WHERE seq_no = 2", "journal record 2"),
    ],
)
def test_corrupt_rows_are_a_store_error_not_a_crash(durable_url: str, opened, sql: str, what: str) -> None:
    store = opened(durable_url)
    store.append([make_record("a"), make_record("b")])
    store.write_snapshot(1, {"v": 1})
    store.close()
    engine = create_engine(durable_url)
    with engine.begin() as conn:
        conn.execute(text(sql), {"junk": b"\x00garbage"} if ":junk" in sql else {})
    engine.dispose()
    with pytest.raises(StoreError, match=what):
        opened(durable_url).recover()


def test_postgres_fixture_runs_a_durable_private_server(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW fsync")).scalar() == "on"
            assert conn.execute(text("SHOW listen_addresses")).scalar() == "127.0.0.1"
    finally:
        engine.dispose()
    assert "@127.0.0.1:" in postgres_url
