from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from block_manager.store import StoreOptions, open_store
from block_manager.store.base import Store

Opener = Callable[..., Store]


@pytest.fixture(scope="session")
def _store_tests_pg_url(postgres_cluster) -> str:  # type: ignore[no-untyped-def]
    """A database of the session cluster used only by these tests (others may keep a
    store open on the shared `postgres_url` database)."""
    return postgres_cluster.create_database("store_tests")


@pytest.fixture
def pg_store_url(_store_tests_pg_url: str) -> str:
    """That database with the store's tables dropped: a clean store for each test without
    paying for CREATE DATABASE (about a second on a loaded 2-core box)."""
    engine = create_engine(_store_tests_pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS journal, snapshots, meta, leadership, alembic_version"))
    finally:
        engine.dispose()
    return _store_tests_pg_url


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return request.getfixturevalue("pg_store_url")


@pytest.fixture(params=["sqlite", "postgres"])
def durable_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return request.getfixturevalue("pg_store_url")


@pytest.fixture
def opened() -> Iterator[Opener]:
    """Open stores through this and they are closed at teardown."""
    stores: list[Store] = []

    def _open(url: str, options: StoreOptions | None = None) -> Store:
        store = open_store(url, options)
        stores.append(store)
        return store

    yield _open
    for store in stores:
        store.close()
