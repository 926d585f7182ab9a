"""Clients with several block-manager addresses follow the leader (real processes, real
PostgreSQL): the sync and async data-plane clients, the admin client and a compute node's link
start on the standby's address and move to the leader; when the leader is paused past its
lease, an unanswered Step is resent under its request id to the new leader and applied once."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from block_manager.cli import admin as admin_cli
from block_manager.client import AsyncBlockManagerClient, BlockManagerClient, RetryPolicy
from block_manager.client.admin import AdminClient
from compute_node.service.bm_link import BlockManagerLink, LinkError
from tests.block_manager.service.failover_helpers import start_server, wait_serving

pytestmark = pytest.mark.postgres

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.02, max_backoff_s=0.2)


def _tokens(admin: AdminClient, seq_id: str) -> int | None:
    for s in admin.list_sequences().get("sequences", []):
        if s["seq_id"] == seq_id:
            return int(s["num_tokens"])
    return None


def _step(client: BlockManagerClient, **kw: object) -> None:
    step = client.step()
    for seq_id, pool, n in kw.get("allocs", ()):  # type: ignore[union-attr]
        step.allocate(seq_id, pool, num_tokens=n)
    for seq_id, n in kw.get("appends", ()):  # type: ignore[union-attr]
        step.append(seq_id, num_new_tokens=n)
    result = step.commit()
    assert not result.failures, result.failures
    for info in result.steps.values():
        client.report(info, True)   # the Forward "ran"


async def test_clients_move_to_the_leader_and_resend_once(
    tmp_path: Path, fresh_postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lease_s = 1.0
    leader = await asyncio.to_thread(start_server, fresh_postgres_url, tmp_path, "leader", lease_s)
    standby = None
    try:
        await wait_serving(leader.address)
        standby = await asyncio.to_thread(start_server, fresh_postgres_url, tmp_path, "standby", lease_s)
        targets = f"{standby.address},{leader.address}"   # the standby first: clients must move on

        client = BlockManagerClient(targets, scheduler_id="sched-sync", retry=FAST_RETRY, timeout_s=1.0)
        admin = AdminClient(targets, retry=FAST_RETRY, timeout_s=1.0)
        aclient = AsyncBlockManagerClient(targets, scheduler_id="sched-async", retry=FAST_RETRY, timeout_s=1.0)
        link = BlockManagerLink(targets, "n0", 1.0)
        try:
            reg = await asyncio.to_thread(client.register_node, "n0", 4096)
            assert client.address == leader.address
            await asyncio.to_thread(_step, client, allocs=[("s0", "n0", 3)])
            assert admin.status()["state"] == "serving"
            await aclient.register_node("n1", 4096)
            astep = aclient.step()
            astep.allocate("a0", "n1", num_tokens=4)
            assert not (await astep.commit()).failures

            # Pause the leader past its lease; the Step below is sent to it, times out, and is
            # resent (same request id) until the standby has taken over and applies it.
            os.kill(leader.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.to_thread(_step, client, appends=[("s0", 2)])
            finally:
                os.kill(leader.proc.pid, signal.SIGCONT)
            assert client.address == standby.address
            assert client.stats.retries >= 1
            assert await asyncio.to_thread(leader.proc.wait, 30) == 3   # the old leader fail-stopped
            assert _tokens(admin, "s0") == 5   # 3 + 2: the resent append applied exactly once
            await asyncio.to_thread(_step, client, appends=[("s0", 4)])   # crosses a block: sent
            assert _tokens(admin, "s0") == 9
            astep = aclient.step()
            astep.append("a0", num_new_tokens=3)
            assert not (await astep.commit()).failures
            assert _tokens(admin, "a0") == 7
            assert admin.fsck()["ok"] is True
            # The admin CLI with both addresses (the dead one first) reports the new leader.
            assert await asyncio.to_thread(
                admin_cli.main, ["status", "--json", "--target", f"{leader.address},{standby.address}"]
            ) == 0
            assert '"state": "serving"' in capsys.readouterr().out

            # A compute node's link: the heartbeat reaches the new leader (the dead address is
            # left after its first failure).
            for _ in range(4):
                try:
                    await link.heartbeat(reg.epoch)
                    break
                except LinkError:
                    continue
            else:
                pytest.fail("the node's link never reached the new leader")
        finally:
            client.close()
            admin.close()
            await aclient.close()
            await link.close()
    finally:
        os.kill(leader.proc.pid, signal.SIGCONT) if leader.proc.poll() is None else None
        leader.stop(signal.SIGKILL)
        if standby is not None:
            assert standby.stop() == 0
