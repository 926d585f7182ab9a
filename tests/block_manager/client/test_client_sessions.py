"""The clients use block-manager sessions without being asked: a step whose answer was lost
is resent, after a block-manager restart, and applied once; the client's acks keep the
server's answer table small; a server without sessions (the in-process block manager) is
still served by request ids."""

from __future__ import annotations

import time

import pytest

from block_manager.client import (
    AsyncBlockManagerClient,
    BlockManagerClient,
    FailedPreconditionError,
    RetryPolicy,
    UnavailableError,
)
from block_manager.core.types import PoolId, SeqId
from block_manager.service.server import BlockManagerServer
from engine.local_bm import LocalBlockManagerClient
from tests.block_manager.client.server_thread import ServerThread, service_config
from tests.block_manager.client.test_client_sync import forward_all

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


def _session_answers(bm: ServerThread, session_id: str) -> int:
    sess = bm.server.runtime.sessions.get(session_id)   # type: ignore[union-attr]
    return len(sess.answers)


def test_sync_client_steps_in_a_session_and_acks_its_answers(bm: ServerThread) -> None:
    with BlockManagerClient(bm.address, retry=FAST_RETRY) as c:
        c.register_node("n1", 64, block_size=4)
        sid = c.session.session_id
        assert sid is not None and c.stats.per_method["OpenSession"] == 1
        for i in range(8):
            step = c.step()
            step.allocate(f"s{i}", "n1", num_tokens=5)
            forward_all(c, step.commit())
        # every answer but the last was acknowledged by the next request: at most one is held
        assert _session_answers(bm, sid) <= 1
        assert c.session.next_seq == 10 and list(c.session.unsettled) == []
        assert c.stats.per_method["OpenSession"] == 1


def test_resend_after_a_restart_is_applied_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every attempt of a Step lost its answer (the server acted on the first); the block
    manager restarts on its database; the scheduler's resend (same session number) gets the
    recorded answer from the journal, and the allocation exists once."""
    db = f"sqlite:///{tmp_path / 'bm.db'}"
    bm = ServerThread(database_url=db)
    try:
        proxy = bm.start_proxy()
        with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY, seed=1) as c:
            c.register_node("n1", 16, block_size=4)
            proxy.fail_after_forward("Step", times=FAST_RETRY.max_attempts)
            step = c.step()
            step.allocate("s", "n1", num_tokens=5)
            with pytest.raises(UnavailableError):
                step.commit()
            assert list(c.session.unsettled) == [2]        # outcome unknown: kept for the resend
            # restart the block manager on the same port and database (the proxy reconnects)
            port = bm.server.port
            bm.lt.run(bm.server.stop(0))
            bm.server = BlockManagerServer(service_config(database_url=db, listen_address=f"127.0.0.1:{port}"))
            bm.lt.run(bm.server.start())
            again = step.resend()
            assert again.allocations["s"].num_cached_tokens == 0
            assert bm.state.core.metrics(PoolId("n1")).num_used_blocks == 2   # allocated once
            assert bm.state.core.get_sequence(SeqId("s")).num_tokens == 5
            assert not c.session.unsettled
            forward_all(c, again)
            assert c.free(["s"]) == 1
        assert bm.fsck() == []
    finally:
        bm.stop()


async def test_async_client_steps_in_a_session(bm: ServerThread) -> None:
    async with AsyncBlockManagerClient(bm.address, retry=FAST_RETRY) as c:
        await c.register_node("n1", 64, block_size=4)
        for i in range(4):
            step = c.step()
            step.allocate(f"s{i}", "n1", num_tokens=5)
            await step.commit()
        sid = c.session.session_id
        assert sid is not None and c.session.next_seq == 6
        assert c.stats.per_method["OpenSession"] == 1


def test_sessions_off_when_the_server_has_none() -> None:
    c = LocalBlockManagerClient()
    c.register_node("n1", 16, block_size=4)
    assert not c.session.enabled and c.session.session_id is None
    step = c.step()
    step.allocate("s", "n1", num_tokens=3)
    assert step.commit().allocations["s"].num_cached_tokens == 0
    assert c.stats.per_method["OpenSession"] == 1   # asked once, then never again
    assert c.stats.errors == 0


def test_an_idle_session_is_replaced_before_it_expires() -> None:
    bm = ServerThread(session_window_s=0.2, session_ttl_s=0.4)
    try:
        with BlockManagerClient(bm.address, retry=FAST_RETRY) as c:
            c.register_node("n1", 16, block_size=4)
            first = c.session.session_id
            time.sleep(0.5)
            step = c.step()
            step.allocate("s", "n1", num_tokens=3)
            step.commit()
            assert c.session.session_id != first and c.stats.per_method["OpenSession"] == 2
            assert c.stats.errors == 0
    finally:
        bm.stop()


def test_a_resend_after_the_window_is_refused_and_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The issue's hole, through the client: a step applied once (its answers lost), resent
    after the session window (and after the request-id window forgot it): refused as expired,
    not applied a second time."""
    bm = ServerThread(
        database_url=f"sqlite:///{tmp_path / 'bm.db'}", session_window_s=0.5, max_retained_requests=1,
        request_retention_s=0.1, snapshot_every_records=1,
    )
    try:
        proxy = bm.start_proxy()
        with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY, seed=3) as c:
            c.register_node("n1", 16, block_size=4)
            step = c.step()
            step.allocate("s", "n1", num_tokens=4)
            forward_all(c, step.commit())
            proxy.fail_after_forward("Step", times=FAST_RETRY.max_attempts)
            step = c.step()
            step.append("s", [9])                            # a new block: the server must hear it
            with pytest.raises(UnavailableError):
                step.commit()
            assert bm.state.core.get_sequence(SeqId("s")).num_tokens == 5   # applied once
            for i in range(3):                               # the request-id window moves on
                other = c.step()
                other.allocate(f"o{i}", "n1", num_tokens=1)
                forward_all(c, other.commit())
            time.sleep(0.7)
            with pytest.raises(FailedPreconditionError, match="expired"):
                step.resend()
            assert bm.state.core.get_sequence(SeqId("s")).num_tokens == 5   # not 6
            assert not c.session.unsettled
        assert bm.fsck() == []
    finally:
        bm.stop()
