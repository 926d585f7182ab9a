"""The PostgreSQL leader lease at the store level: a silent leader's session is ended by the
server after one lease, its lock passes to the next opener (with a higher epoch), and the old
store can neither commit nor claim to be fresh.

Leases of a second or more, not a few hundred ms: the server also ends a session that is silent
*inside* a transaction for a lease, and on a loaded 2-core machine a starved thread can pause
that long between two statements of opening the store (a suite run at load 18 failed so, issue 24)."""

from __future__ import annotations

import threading
import time

import pytest
from store_helpers import make_record

from block_manager.store import StoreError, StoreLocked, StoreOptions, open_store

pytestmark = pytest.mark.postgres


def test_silent_leader_loses_lock_and_cannot_commit(pg_store_url: str) -> None:
    lease = StoreOptions(leader_lease_s=1.0)
    old = open_store(pg_store_url, lease)
    try:
        assert old.append([make_record("before")]) == [1]
        assert old.leadership_fresh()
        with pytest.raises(StoreLocked):
            open_store(pg_store_url, StoreOptions(leader_lease_s=1.0))
        time.sleep(1.6)   # no keepalive: silent for longer than the lease (a paused process)
        assert not old.leadership_fresh()   # it knows before it tries anything
        new = open_store(pg_store_url, StoreOptions(leader_lease_s=1.0, lock_wait_s=5))
        try:
            assert new.epoch == old.epoch + 1
            with pytest.raises(StoreError):
                old.append([make_record("after-takeover")])   # the fenced session cannot commit
            assert new.append([make_record("by-new")]) == [2]
            assert [r.request_id for r in new.recover().records] == ["before", "by-new"]
        finally:
            new.close()
    finally:
        old.close()


def test_keepalive_holds_the_lock_past_the_lease(pg_store_url: str) -> None:
    store = open_store(pg_store_url, StoreOptions(leader_lease_s=1.0))
    lost: list[BaseException] = []
    try:
        store.start_keepalive(lost.append)
        time.sleep(3.0)   # three leases
        assert lost == [] and store.leadership_fresh()
        with pytest.raises(StoreLocked):
            open_store(pg_store_url, StoreOptions(leader_lease_s=1.0, lock_wait_s=0.2))
        assert store.append([make_record("still-leading")]) == [1]
    finally:
        store.close()


def test_keepalive_reports_a_lost_session(pg_store_url: str, postgres_cluster) -> None:  # type: ignore[no-untyped-def]
    store = open_store(pg_store_url, StoreOptions(leader_lease_s=1.5))   # only the kill ends it
    lost = threading.Event()
    try:
        store.start_keepalive(lambda exc: lost.set())
        from sqlalchemy import create_engine, text

        engine = create_engine(pg_store_url)
        with engine.begin() as conn:   # an operator (or a failover tool) ends the leader's session
            conn.execute(text(   # this database's lock holder only (other tests' databases untouched)
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ))
        engine.dispose()
        assert lost.wait(5)
        assert not store.leadership_fresh()
        with pytest.raises(StoreError):
            store.append([make_record("x")])
    finally:
        store.close()
