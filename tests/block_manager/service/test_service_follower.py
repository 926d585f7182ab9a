"""A standby's warm copy (service/follower.py): following the journal of a serving block
manager on PostgreSQL reproduces its core state exactly, through snapshots that prune records
the follower had not read (it reloads from the snapshot)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from block_manager.service.follower import JournalFollower
from block_manager.service.runtime import ServiceRuntime
from block_manager.store import StoreOptions, open_store
from block_manager.store.reader import JournalReader
from tests.block_manager.service.service_helpers import Harness

pytestmark = pytest.mark.postgres


async def _load(h: Harness, prefix: str, n: int) -> None:
    for i in range(n):
        await h.allocate(f"{prefix}{i}", num_tokens=5)
        await h.append((f"{prefix}{i}", 4))
        if i % 2:
            await h.free(f"{prefix}{i}")


def _catch_up(follower: JournalFollower, target: int) -> None:
    for _ in range(50):
        follower.poll()
        if follower.seq_no >= target:
            return
    raise AssertionError(f"follower stuck at {follower.seq_no} < {target} (reloads {follower.num_reloads}, "
                         f"copy {follower._state is not None}, applied {follower.num_applied})")


def _same_core(follower: JournalFollower, h: Harness) -> None:
    warm = follower.warm()
    assert warm is not None
    assert warm.state.core.to_snapshot() == h.server.runtime.state.core.to_snapshot()   # type: ignore[union-attr]
    assert warm.state.fsck() == []


async def test_follower_reproduces_the_leaders_state(
    start_server: Callable[..., Any], fresh_postgres_url: str
) -> None:
    h = await start_server(database_url=fresh_postgres_url, snapshot_every_records=7)
    await h.register("n1", num_blocks=256)
    await _load(h, "a", 6)
    cfg = h.server.config
    follower = JournalFollower(JournalReader(fresh_postgres_url), cfg.state_config(), time.monotonic)
    try:
        await asyncio.to_thread(_catch_up, follower, h.server.runtime.writer.last_seq_no)   # type: ignore[union-attr]
        await _load(h, "b", 6)   # more records, and snapshots, after its first poll
        await asyncio.to_thread(_catch_up, follower, h.server.runtime.writer.last_seq_no)   # type: ignore[union-attr]
        assert follower.num_reloads == 1
        _same_core(follower, h)
    finally:
        follower.close()


async def test_follower_reloads_when_a_snapshot_pruned_its_next_records(
    start_server: Callable[..., Any], fresh_postgres_url: str
) -> None:
    h = await start_server(database_url=fresh_postgres_url, snapshot_every_records=4, max_retained_requests=1,
                           request_retention_s=0.001)
    await h.register("n1", num_blocks=256)
    await _load(h, "a", 3)
    cfg = h.server.config
    follower = JournalFollower(JournalReader(fresh_postgres_url), cfg.state_config(), time.monotonic)
    try:
        follower.poll()
        behind = follower.seq_no
        await _load(h, "b", 8)   # snapshots prune everything but the last record meanwhile
        target = h.server.runtime.writer.last_seq_no   # type: ignore[union-attr]
        assert target > behind + 4
        await asyncio.to_thread(_catch_up, follower, target)
        assert follower.num_reloads >= 2   # the gap was noticed and the copy rebuilt
        _same_core(follower, h)
    finally:
        follower.close()


async def test_takeover_with_a_stale_copy_recovers_from_the_store(
    start_server: Callable[..., Any], fresh_postgres_url: str
) -> None:
    """A copy the journal has moved past (pruned by snapshots) is not used half-way: the new
    leader recovers from the store and ends with the old leader's exact state."""
    h = await start_server(database_url=fresh_postgres_url, snapshot_every_records=4, max_retained_requests=1,
                           request_retention_s=0.001)
    await h.register("n1", num_blocks=256)
    await _load(h, "a", 3)
    cfg = h.server.config
    follower = JournalFollower(JournalReader(fresh_postgres_url), cfg.state_config(), time.monotonic)
    try:
        await asyncio.to_thread(follower.poll)
        await _load(h, "b", 8)
        expected = h.server.runtime.state.core.to_snapshot()   # type: ignore[union-attr]
        await h.server.stop(0)   # final snapshot: the copy is now far behind a pruned journal
        warm = follower.warm()
        assert warm is not None and warm.seq_no < h.server.runtime.writer.last_seq_no   # type: ignore[union-attr]
    finally:
        follower.close()
    store = await asyncio.to_thread(open_store, fresh_postgres_url, StoreOptions(lock_wait_s=10))
    runtime = ServiceRuntime(cfg, store)
    try:
        await runtime.start(warm)
        assert runtime.recovered_warm is False   # the copy was refused, the store recovered
        assert runtime.state.core.to_snapshot() == expected
        assert runtime.state.fsck() == []
    finally:
        await runtime.close()
