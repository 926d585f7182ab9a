"""Exactly-once by client sessions, over real gRPC and a real SQLite file (and a real PostgreSQL
server for the restart tests, started by the test setup).

A sessioned request resent within the session window gets the identical recorded answer; one
resent after it (long after the request-id window forgot its id) is refused as expired
(FAILED_PRECONDITION) and changes nothing — neither the state nor the journal; both hold across
a block-manager restart (graceful: the answers come back from the snapshot; SIGKILL: from the
journal's records). Also: TriggerDefrag("") resent gets its recorded answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from block_manager.service.server import BlockManagerServer
from demo.localstack import ServiceProcess
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import (
    Harness,
    eventually,
    expect_code,
    rid,
    service_config,
    step_request,
)

REPO = Path(__file__).resolve().parents[3]


class Servers:
    """In-process block managers on one database (a SQLite file, or a PostgreSQL database),
    restarted at will."""

    def __init__(self, url: str, **overrides: Any) -> None:
        self.url = url
        self.overrides = overrides
        self.h: Harness | None = None

    async def start(self) -> Harness:
        server = BlockManagerServer(service_config(database_url=self.url, **self.overrides))
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.h = Harness(server, channel, pb_grpc.BlockManagerStub(channel), pb_grpc.BlockManagerAdminStub(channel))
        return self.h

    async def stop(self) -> None:
        if self.h is not None:
            await self.h.channel.close()
            await self.h.server.stop(0)
            self.h = None

    async def restart(self) -> Harness:
        await self.stop()
        return await self.start()


@pytest.fixture
async def servers(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """`servers(backend="sqlite" | "postgres", **config)`: a restartable block manager."""
    made: list[Servers] = []

    def make(backend: str = "sqlite", **overrides: Any) -> Servers:
        if backend == "postgres":
            url = request.getfixturevalue("fresh_postgres_url")
        else:
            url = f"sqlite:///{tmp_path / 'bm.db'}"
        s = Servers(url, **overrides)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.stop()


def journal(url: str) -> tuple[int, int]:
    """(highest seq_no, number of step records) of the journal, read beside the server."""
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as conn:
            last = conn.execute(sqlalchemy.text("SELECT COALESCE(MAX(seq_no), 0) FROM journal")).scalar_one()
            steps = conn.execute(sqlalchemy.text("SELECT COUNT(*) FROM journal WHERE op = 'step'")).scalar_one()
    finally:
        engine.dispose()
    return int(last), int(steps)


def stamped(req: Any, session_id: str, seq: int, acked: int = 0) -> Any:
    req.session.session_id, req.session.seq, req.session.acked = session_id, seq, acked
    return req


def reported(h: Harness, resp: pb.StepResponse) -> None:
    """Take the PoolSteps of `resp` as run: reported with the next step (as `Harness.step`)."""
    for ps in resp.steps:
        done = h.reports.get(ps.pool_id, (ps.epoch, 0, 0))[1]
        h.reports[ps.pool_id] = (ps.epoch, max(done, ps.step_id), 0)


async def sstep(h: Harness, sid: str, seq: int, acked: int = 0, **kw: Any) -> tuple[pb.StepRequest, pb.StepResponse]:
    """A sessioned step carrying the pending reports; its PoolSteps count as run."""
    req = stamped(step_request(reports=dict(h.reports), **kw), sid, seq, acked)
    resp = await h.stub.Step(req)
    h.reports.clear()
    reported(h, resp)
    return req, resp


async def open_session(h: Harness, name: str = "test") -> str:
    return (await h.stub.OpenSession(pb.OpenSessionRequest(client_name=name))).session_id


async def num_tokens(h: Harness, seq_id: str) -> int:
    return (await h.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id=seq_id))).table.num_tokens


async def _setup(h: Harness, sid: str) -> tuple[pb.StepRequest, pb.StepResponse]:
    """Pool n1, sequence `a` of 4 tokens (session number 1), then number 2: one append."""
    await h.register("n1")
    await sstep(h, sid, 1, allocs=[("a", "n1", None, 4, None, 0)])
    return await sstep(h, sid, 2, appends=[("a", 1)])


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_resend_within_the_window_gets_the_identical_answer_also_after_a_restart(
    servers: Any, backend: str
) -> None:
    s = servers(backend, session_window_s=60.0)
    h = await s.start()
    sid = await open_session(h)
    append, first = await _setup(h, sid)
    assert await num_tokens(h, "a") == 5
    resend = pb.StepRequest()
    resend.CopyFrom(append)
    resend.request_id = "another-id-for-the-logs"   # the session number is the key
    assert (await h.stub.Step(resend)).SerializeToString() == first.SerializeToString()
    assert await num_tokens(h, "a") == 5
    before = journal(s.url)
    h = await s.restart()
    assert journal(s.url) == before
    assert (await h.stub.Step(append)).SerializeToString() == first.SerializeToString()
    assert await num_tokens(h, "a") == 5
    assert journal(s.url)[0] == before[0]   # nothing journaled by the resend
    # the same number with another request is refused, not applied
    other = stamped(step_request(appends=[("a", 2)]), sid, 2)
    await expect_code(h.stub.Step(other), grpc.StatusCode.INVALID_ARGUMENT)
    # the session goes on after the restart
    await sstep(h, sid, 3, appends=[("a", 1)])
    assert await num_tokens(h, "a") == 6


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_late_resend_is_refused_as_expired_and_changes_nothing(servers: Any, backend: str) -> None:
    """The issue's reproduction: the request id is long forgotten (a tiny request-id window,
    snapshots pruning the journal), the resend comes after the session window: refused,
    nothing applied, nothing journaled — and still so after a restart."""
    s = servers(
        backend, session_window_s=1.0, max_retained_requests=2, request_retention_s=0.1, snapshot_every_records=2
    )
    h = await s.start()
    sid = await open_session(h)
    append, _ = await _setup(h, sid)
    for i in range(6):   # other requests push the ids out of the request-id window
        await h.step(allocs=[(f"o{i}", "n1", None, 1, None, 0)])
    await asyncio.sleep(1.2)
    before = journal(s.url)
    err = await expect_code(h.stub.Step(append), grpc.StatusCode.FAILED_PRECONDITION)
    assert "expired" in err.details() and "not applied again" in err.details()
    assert await num_tokens(h, "a") == 5
    assert journal(s.url) == before
    h = await s.restart()
    await expect_code(h.stub.Step(append), grpc.StatusCode.FAILED_PRECONDITION)
    assert await num_tokens(h, "a") == 5
    assert journal(s.url)[0] == before[0]
    assert await h.fsck() == []


async def test_acknowledged_answers_are_dropped_and_the_table_is_bounded(servers: Any) -> None:
    s = servers(session_window_s=60.0, max_session_answers=3)
    h = await s.start()
    sid = await open_session(h)
    append, _ = await _setup(h, sid)
    # number 3 says "I hold every answer below 3": number 2's answer goes at once
    await sstep(h, sid, 3, acked=3, appends=[("a", 1)])
    await expect_code(h.stub.Step(append), grpc.StatusCode.FAILED_PRECONDITION)
    # without acks at most 3 answers are held: the oldest go first, refused after
    done = [await sstep(h, sid, n, appends=[("a", 1)]) for n in range(4, 9)]
    runtime = h.server.runtime
    assert runtime is not None and runtime.sessions.num_answers <= 3
    await expect_code(h.stub.Step(done[0][0]), grpc.StatusCode.FAILED_PRECONDITION)
    assert await h.stub.Step(done[-1][0]) == done[-1][1]
    assert await num_tokens(h, "a") == 5 + 1 + 5
    text = (await asyncio.to_thread(h.server.metrics.render)).decode()
    assert "pagedkv_client_sessions 1.0" in text
    assert "pagedkv_client_session_refusals_total 2.0" in text


async def test_unknown_and_idle_sessions_are_refused_also_after_a_restart(servers: Any) -> None:
    s = servers(session_window_s=0.2, session_ttl_s=0.4)
    h = await s.start()
    await h.register("n1")
    req = stamped(step_request(allocs=[("a", "n1", None, 4, None, 0)]), "0" * 32, 1)
    err = await expect_code(h.stub.Step(req), grpc.StatusCode.FAILED_PRECONDITION)
    assert err.details().startswith("session expired:")
    sid = await open_session(h)
    await sstep(h, sid, 1, allocs=[("a", "n1", None, 4, None, 0)])
    runtime = h.server.runtime
    assert runtime is not None
    await eventually(lambda: runtime.sessions.get(sid) is None, timeout_s=10, what="session expiry")
    h = await s.restart()
    nxt = stamped(step_request(appends=[("a", 1)]), sid, 2)
    err = await expect_code(h.stub.Step(nxt), grpc.StatusCode.FAILED_PRECONDITION)
    assert err.details().startswith("session expired:")
    assert await num_tokens(h, "a") == 4


async def test_malformed_session_fields_are_invalid_argument(servers: Any) -> None:
    h = await servers().start()
    await h.register("n1")
    sid = await open_session(h)
    for bad in (stamped(step_request(), "not-hex!", 1), stamped(step_request(), sid, 0),
                stamped(step_request(), sid, 2, acked=3), stamped(step_request(), "a" * 65, 1)):
        await expect_code(h.stub.Step(bad), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_code(h.stub.OpenSession(pb.OpenSessionRequest(client_name="x" * 129)),
                      grpc.StatusCode.INVALID_ARGUMENT)


async def _two_fragmented_pools(h: Harness) -> None:
    for pool in ("n1", "n2"):
        await h.register(pool, num_blocks=16)
        await h.step(allocs=[(f"{pool}-s{i}", pool, None, 4, None, 0) for i in range(6)])
        await h.free(f"{pool}-s0", f"{pool}-s1", f"{pool}-s2")


async def test_trigger_defrag_for_every_pool_resent_gets_the_recorded_answer(servers: Any) -> None:
    """It answered 0 plans on a resend: the recorded answer was lost because the pools that
    got a plan were skipped before the id was looked up. Now the trigger is one journaled op."""
    s = servers()
    h = await s.start()
    await _two_fragmented_pools(h)
    req = pb.TriggerDefragRequest(request_id=rid("defrag"), pool_id="")
    first = await h.admin.TriggerDefrag(req)
    assert sorted(p.pool_id for p in first.plans) == ["n1", "n2"]
    assert (await h.admin.TriggerDefrag(req)).SerializeToString() == first.SerializeToString()
    h = await s.restart()
    assert (await h.admin.TriggerDefrag(req)).SerializeToString() == first.SerializeToString()
    # a new trigger finds both pools busy: no plan, nothing changed
    assert list((await h.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id=rid("defrag")))).plans) == []
    # and in a session, the same
    sid = await open_session(h)
    await h.step(appends=[("n1-s3", 1), ("n2-s3", 1)])
    await h.step(appends=[("n1-s4", 1), ("n2-s4", 1)])   # the plans commit
    sreq = stamped(pb.TriggerDefragRequest(request_id=rid("defrag")), sid, 1)
    again = await h.admin.TriggerDefrag(sreq)
    assert (await h.admin.TriggerDefrag(sreq)).SerializeToString() == again.SerializeToString()


# ---- SIGKILL: the answers come back from the journal's records ----------------------------

WINDOW_S = 10.0   # long enough for a process restart on a loaded 2-core machine
# The node's lease outlives the test: at the default 10 s (= WINDOW_S) it expired, and fenced
# the node and dropped its sequence, just before the last check whenever the restart was fast.
SERVER_ENV = {"PAGEDKV_BLOCK_SIZE": "4", "PAGEDKV_DEFRAG__ENABLED": "false", "PAGEDKV_STORE_LOCK_WAIT_S": "20",
              "PAGEDKV_SESSION_WINDOW_S": str(WINDOW_S), "PAGEDKV_SNAPSHOT_EVERY_RECORDS": "100000",
              "PAGEDKV_LEASE_TTL_S": "120"}


def _start_process(db: Path, tmp: Path, name: str) -> ServiceProcess:
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url",
            f"sqlite:///{db}"]
    return ServiceProcess.start(argv, workdir=tmp, name=name, env={**os.environ, **SERVER_ENV}, cwd=REPO, timeout_s=60)


async def _serving(channel: grpc.aio.Channel) -> None:
    async def ok() -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    await eventually(ok, timeout_s=60, interval_s=0.05, what="SERVING")


async def test_answers_and_expiry_survive_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "bm.db"
    first = await asyncio.to_thread(_start_process, db, tmp_path, "first")
    try:
        async with grpc.aio.insecure_channel(first.address) as ch:
            await _serving(ch)
            stub = pb_grpc.BlockManagerStub(ch)
            await stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg", node_id="n1", num_blocks=64))
            sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="kill"))).session_id
            await stub.Step(stamped(step_request(allocs=[("a", "n1", None, 4, None, 0)]), sid, 1))
            append = stamped(step_request(appends=[("a", 1)], reports={"n1": (1, 1, 0)}), sid, 2)
            answer = await stub.Step(append)
            answered_at = time.time()
    finally:
        first.stop(signal.SIGKILL)   # no final snapshot: recovery replays the records
    before = journal(f"sqlite:///{db}")
    second = await asyncio.to_thread(_start_process, db, tmp_path, "second")
    try:
        async with grpc.aio.insecure_channel(second.address) as ch:
            await _serving(ch)
            stub = pb_grpc.BlockManagerStub(ch)
            admin = pb_grpc.BlockManagerAdminStub(ch)
            assert (await stub.Step(append)).SerializeToString() == answer.SerializeToString()
            assert time.time() < answered_at + WINDOW_S, "the restart took longer than the window"
            # past the window (timed by the journal record's wall clock, which survived)
            await asyncio.sleep(answered_at + WINDOW_S + 0.3 - time.time())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Step(append)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            table = (await admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="a"))).table
            assert table.num_tokens == 5
            assert journal(f"sqlite:///{db}")[0] == before[0]
    finally:
        second.stop(signal.SIGKILL)
