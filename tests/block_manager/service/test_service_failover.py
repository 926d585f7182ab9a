"""Active/standby on a throwaway PostgreSQL with real processes (service/leadership.py).

- kill -9 of the leader under continuous Step load from two schedulers: the standby serves
  within 2 x the lease; every Step is acknowledged exactly once (unanswered ones are resent
  under their request ids to whichever server answers), none is lost or applied twice (live
  state and the journal inspected), fsck is clean.
  A KV events subscriber of the leader gets a Resync on the new leader, with higher ids.
- SIGSTOP of the leader past its lease: the standby takes over; the resumed old leader
  answers nothing (its pending Step is refused, it exits), its Step resent to the new leader
  is applied once, and everything it acknowledged before the pause is kept.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, text

from block_manager.service.server import REPLICA_HEALTH
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.failover_helpers import health, start_server, wait_serving
from tests.block_manager.service.kv_events_helpers import Subscriber
from tests.block_manager.service.service_helpers import step_request
from tests.support.polling import eventually

pytestmark = pytest.mark.postgres

SCHEDULERS = ("sched-a", "sched-b")   # each drives its own pool (node) with two workers
WORKERS_PER_SCHEDULER = 2
MIN_ACKED_BEFORE_KILL = 60
OPS_AFTER_TAKEOVER = 40
LOAD_DEADLINE_S = 60.0


@dataclass
class Cluster:
    """Channels to every block manager; a call goes to the one that answers."""

    addresses: list[str]
    channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    current: int = 0

    def stub(self, i: int) -> pb_grpc.BlockManagerStub:
        addr = self.addresses[i]
        if addr not in self.channels:
            self.channels[addr] = grpc.aio.insecure_channel(addr)
        return pb_grpc.BlockManagerStub(self.channels[addr])

    async def step(self, req: pb.StepRequest, deadline_s: float = 60.0) -> tuple[pb.StepResponse, float]:
        """Send (and resend under the same request id) until some server acknowledges it."""
        end = time.monotonic() + deadline_s
        while True:
            i = self.current
            try:
                return await self.stub(i).Step(req, timeout=3), time.monotonic()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() > end:
                    raise
                self.current = (i + 1) % len(self.addresses)
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


@dataclass
class Worker:
    scheduler_id: str
    pool: str
    wid: int
    expected: dict[str, int] = field(default_factory=dict)   # live seq -> num_tokens
    freed: set[str] = field(default_factory=set)
    acked_ids: list[str] = field(default_factory=list)
    ack_times: list[float] = field(default_factory=list)
    num_seqs: int = 0


LAST_STEP: dict[str, int] = {}


async def run_worker(cluster: Cluster, w: Worker, stop: asyncio.Event, max_ops: int | None = None) -> None:
    while not stop.is_set() and (max_ops is None or len(w.acked_ids) < max_ops):
        w.num_seqs += 1
        n = w.num_seqs
        sid = f"{w.scheduler_id}-w{w.wid}-s{n}"
        ops: list[tuple[str, dict]] = [("alloc", {"allocs": [(sid, w.pool, None, 3, None, 0)]})]
        ops += [("append", {"appends": [(sid, 2)]}) for _ in range(3)]
        if n % 2:
            ops.append(("free", {"frees": [sid]}))
        for i, (kind, sections) in enumerate(ops):
            req = step_request(
                scheduler_id=w.scheduler_id, request_id=f"{sid}-{i}",
                reports={w.pool: (1, LAST_STEP.get(w.pool, 0), 0)}, **sections,
            )
            resp, at = await cluster.step(req)   # an op, once started, is carried to its ack
            for ps in resp.steps:
                LAST_STEP[ps.pool_id] = max(LAST_STEP.get(ps.pool_id, 0), ps.step_id)
            w.acked_ids.append(req.request_id)
            w.ack_times.append(at)
            if kind == "alloc":
                w.expected[sid] = 3
            elif kind == "append":
                w.expected[sid] += 2
            else:
                del w.expected[sid]
                w.freed.add(sid)


async def register_pools(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        for k in range(len(SCHEDULERS)):
            await stub.RegisterNode(pb.RegisterNodeRequest(request_id=f"reg-n{k}", node_id=f"n{k}", num_blocks=8192))


async def check_state(address: str, workers: list[Worker], url: str) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        admin = pb_grpc.BlockManagerAdminStub(ch)
        live = {s.seq_id: s.num_tokens for s in (await admin.ListSequences(pb.ListSequencesRequest())).sequences}
        expected = {sid: t for w in workers for sid, t in w.expected.items()}
        assert live == expected   # nothing acknowledged lost, nothing applied twice
        fsck = await admin.Fsck(pb.FsckRequest())
        assert fsck.ok, list(fsck.problems)
        status = await admin.Status(pb.StatusRequest())
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            ids = Counter(r[0] for r in conn.execute(text("SELECT request_id FROM journal WHERE op = 'step'")))
            epoch = conn.execute(text("SELECT epoch FROM leadership")).scalar_one()
    finally:
        engine.dispose()
    acked = [rid for w in workers for rid in w.acked_ids]
    assert len(acked) == len(set(acked))
    # Every acknowledged mutating Step is journaled exactly once (the snapshot interval prunes
    # nothing here: retention keeps 10 000 ids). Steps that changed nothing are not journaled.
    assert all(ids[rid] <= 1 for rid in acked)
    assert sum(1 for rid in acked if ids[rid] == 1) >= len(acked) * 0.9
    assert epoch >= 2 and status.leader_epoch == epoch   # the new leader's term is the newest


def _journaled(url: str, request_id: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(
                text("SELECT count(*) FROM journal WHERE request_id = :rid"), {"rid": request_id}
            ).scalar_one())
    finally:
        engine.dispose()


async def test_kill9_leader_under_load_standby_takes_over(tmp_path: Path, fresh_postgres_url: str) -> None:
    lease_s = 2.0
    LAST_STEP.clear()
    leader = await asyncio.to_thread(start_server, fresh_postgres_url, tmp_path, "leader", lease_s)
    standby = None
    cluster = None
    events, events_channel = Subscriber(), grpc.aio.insecure_channel(leader.address)
    try:
        await wait_serving(leader.address)
        standby = await asyncio.to_thread(start_server, fresh_postgres_url, tmp_path, "standby", lease_s)
        assert await health(standby.address) == "NOT_SERVING"
        assert await health(standby.address, REPLICA_HEALTH) == "SERVING"
        async with grpc.aio.insecure_channel(standby.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.BlockManagerStub(ch).Step(step_request(request_id="probe"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "standby" in info.value.details()
            # KV events: only the leader streams (docs/kv_events.md)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.BlockManagerStub(ch).SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=5).read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "standby" in info.value.details()
        await register_pools(leader.address)
        events.start(pb_grpc.BlockManagerStub(events_channel))
        cluster = Cluster([leader.address, standby.address])
        workers = [Worker(s, f"n{k}", i) for k, s in enumerate(SCHEDULERS) for i in range(WORKERS_PER_SCHEDULER)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_worker(cluster, w, stop)) for w in workers]
        deadline = time.monotonic() + LOAD_DEADLINE_S
        while sum(len(w.acked_ids) for w in workers) < MIN_ACKED_BEFORE_KILL and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        num_before = sum(len(w.acked_ids) for w in workers)
        # The standby follows the journal while it waits (its Status shows how far).
        async with grpc.aio.insecure_channel(standby.address) as ch:
            admin = pb_grpc.BlockManagerAdminStub(ch)
            for _ in range(100):
                status = await admin.Status(pb.StatusRequest(), timeout=5)
                if status.last_seq_no > 0:
                    break
                await asyncio.sleep(0.05)
            assert status.state == "standby" and status.last_seq_no > 0
        killed_at = time.monotonic()
        leader.stop(signal.SIGKILL)   # mid-load: Steps are in flight
        while sum(len(w.acked_ids) for w in workers) < num_before + OPS_AFTER_TAKEOVER:
            assert time.monotonic() < deadline + 60, "load stalled after the kill"
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*tasks)
        first_after = min(t for w in workers for t in w.ack_times if t > killed_at)
        takeover_s = first_after - killed_at
        print(f"failover: first acknowledged Step {takeover_s:.3f} s after kill -9 (lease {lease_s} s)")
        assert takeover_s < 2 * lease_s
        assert await health(standby.address) == "SERVING"
        await check_state(standby.address, workers, fresh_postgres_url)
        log = standby.log_path.read_text() if standby.log_path else ""
        print(*[line for line in log.splitlines() if "takeover_s" in line or '"recovered"' in line], sep="\n")
        assert '"warm": true' in log and "warm takeover failed" not in log   # it took over from its copy
        # The KV events stream ended with the leader; on the new one the last id is not held:
        # a Resync and a snapshot, ids above every id the killed leader published.
        await eventually(lambda: events.ended is not None or events.error is not None, what="the stream ended")
        last_id = events.view.last_event_id
        assert events.error is None and events.view.num_resyncs == 1 and last_id > 0
        await events_channel.close()
        events_channel = grpc.aio.insecure_channel(standby.address)
        events.start(pb_grpc.BlockManagerStub(events_channel))
        await eventually(lambda: events.view.num_resyncs == 2 and events.view.ready, what="a resync on the new leader")
        assert events.view.resync_reasons[-1] == f"event {last_id} is not held" and events.first_ids[-1] > last_id
    finally:
        await events.stop()
        await events_channel.close()
        if cluster is not None:
            await cluster.close()
        leader.stop(signal.SIGKILL)
        if standby is not None:
            assert standby.stop() == 0


async def test_sigstopped_leader_is_fenced_after_takeover(tmp_path: Path, fresh_postgres_url: str) -> None:
    lease_s = 1.0
    LAST_STEP.clear()
    old = await asyncio.to_thread(start_server, fresh_postgres_url, tmp_path, "old", lease_s)
    new = None
    cluster = None
    try:
        await wait_serving(old.address)
        new = await asyncio.to_thread(start_server, fresh_postgres_url, tmp_path, "new", lease_s)
        await register_pools(old.address)
        cluster = Cluster([old.address])
        w = Worker(SCHEDULERS[0], "n0", 0)
        await run_worker(cluster, w, asyncio.Event(), max_ops=12)   # acknowledged by the old leader

        os.kill(old.proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        await wait_serving(new.address, timeout_s=30)
        print(f"takeover after SIGSTOP: {time.monotonic() - stopped_at:.3f} s (lease {lease_s} s)")
        assert time.monotonic() - stopped_at >= lease_s * 0.9   # not before the old lease ran out

        # A Step sent to the paused old leader: it waits in its socket until the process wakes.
        sid = "fenced-seq"
        pending_req = step_request(scheduler_id=w.scheduler_id, request_id="fenced-alloc",
                                   allocs=[(sid, "n0", None, 5, None, 0)])
        async with grpc.aio.insecure_channel(old.address) as ch:
            pending = asyncio.ensure_future(pb_grpc.BlockManagerStub(ch).Step(pending_req, timeout=20))
            await asyncio.sleep(0.3)
            # The new leader serves meanwhile (the scheduler moved over).
            cluster.addresses[:] = [new.address]
            cluster.current = 0
            await run_worker(cluster, w, asyncio.Event(), max_ops=len(w.acked_ids) + 8)
            os.kill(old.proc.pid, signal.SIGCONT)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pending
        # Refused, never acknowledged: the old leader knew at once its lease had run out.
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        # Whichever noticed first on waking refused it: the lease check before answering ("lost
        # its leadership lease"), the failed keepalive that turned the server "failed", or the
        # fail-stop shutdown cancelling the call. Its write is nowhere in the journal:
        assert _journaled(fresh_postgres_url, pending_req.request_id) == 0
        # ... and it stops (its database session is gone): exit code 3, fail-stop.
        assert await asyncio.to_thread(old.proc.wait, 30) == 3
        # The unanswered Step, resent under its id to the new leader, is applied once.
        first, _ = await cluster.step(pending_req)
        again, _ = await cluster.step(pending_req)
        assert first == again
        assert _journaled(fresh_postgres_url, pending_req.request_id) == 1
        w.expected[sid] = 5
        w.acked_ids.append(pending_req.request_id)
        await check_state(new.address, [w], fresh_postgres_url)
    finally:
        if cluster is not None:
            await cluster.close()
        try:
            os.kill(old.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        old.stop(signal.SIGKILL)
        if new is not None:
            assert new.stop() == 0
