"""Crash recovery with a real server process: SIGKILL mid-load, restart on the same
database, every acknowledged operation is present, in-flight retries act exactly once,
and fsck is clean. Run against SQLite (file, WAL) and PostgreSQL (throwaway cluster)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from demo.localstack import ServiceProcess
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import step_request
from tests.support.polling import eventually

REPO = Path(__file__).resolve().parents[3]
NUM_WORKERS = 6
MIN_ACKED = 240          # kill once this many ops were acknowledged ...
LOAD_DEADLINE_S = 30.0   # ... or after this long, whichever first


SERVER_ENV = {
    "PAGEDKV_BLOCK_SIZE": "4",
    "PAGEDKV_SNAPSHOT_EVERY_RECORDS": "64",  # exercise snapshot + replay together
    "PAGEDKV_LEASE_TTL_S": "60",
    "PAGEDKV_DEFRAG__ENABLED": "false",
    "PAGEDKV_STORE_LOCK_WAIT_S": "20",
    "PAGEDKV_MAX_UNSETTLED_STEPS": "64",  # six workers close steps faster than reports catch up
}
LAST_STEP = [0]


def start_server(database_url: str, tmp: Path, name: str) -> ServiceProcess:
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url"]
    return ServiceProcess.start(
        [*argv, database_url], workdir=tmp, name=name, env={**os.environ, **SERVER_ENV}, cwd=REPO, timeout_s=30
    )


@dataclass
class Worker:
    """One sequence at a time, ops strictly sequential: at the kill at most one op per
    worker is unacknowledged, so the expected state is exact."""

    wid: int
    acked: dict[str, int] = field(default_factory=dict)        # live seq -> acked num_tokens
    freed: set[str] = field(default_factory=set)
    inflight: tuple[str, object] | None = None                   # (kind, request)
    num_acked: int = 0
    responses: list[tuple[str, object, object]] = field(default_factory=list)


async def _load(stub: pb_grpc.BlockManagerStub, w: Worker, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        sid = f"w{w.wid}-s{n}"
        ops: list[tuple[str, dict]] = [("alloc", {"allocs": [(sid, "n1", None, 3, None, 0)]})]
        ops += [("append", {"appends": [(sid, 2)]}) for _ in range(4)]
        if n % 2:
            ops.append(("free", {"frees": [sid]}))
        for i, (kind, sections) in enumerate(ops):
            if stop.is_set():
                return
            # Every step reports the latest step any worker saw (their Forwards "ran").
            req = step_request(request_id=f"{sid}-{i}", reports={"n1": (1, LAST_STEP[0], 0)}, **sections)
            w.inflight = (kind, req)
            try:
                resp = await _call(stub, kind, req)
            except grpc.aio.AioRpcError:
                return  # the server died under us: this op stays in flight
            w.inflight = None
            for ps in resp.steps:  # type: ignore[attr-defined]
                LAST_STEP[0] = max(LAST_STEP[0], ps.step_id)
            w.num_acked += 1
            w.responses.append((kind, req, resp))
            _account(w, kind, req)


async def _call(stub: pb_grpc.BlockManagerStub, kind: str, req: pb.StepRequest) -> pb.StepResponse:
    return await stub.Step(req, timeout=10)


def _account(w: Worker, kind: str, req: pb.StepRequest) -> None:
    if kind == "alloc":
        w.acked[req.alloc_seq_ids[0]] = 3
    elif kind == "append":
        w.acked[req.append_seq_ids[0]] += 2
    else:
        sid = req.free_seq_ids[0]
        del w.acked[sid]
        w.freed.add(sid)


async def _wait_serving(channel: grpc.aio.Channel, timeout: float = 60.0) -> None:
    async def serving() -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    await eventually(serving, timeout_s=timeout, interval_s=0.05, what="SERVING")


async def _crash_and_recover(database_url: str, tmp: Path) -> None:
    LAST_STEP[0] = 0
    first = await asyncio.to_thread(start_server, database_url, tmp, "first")
    port = first.port
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await _wait_serving(ch)
            stub = pb_grpc.BlockManagerStub(ch)
            reg = await stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg-n1", node_id="n1", num_blocks=4096))
            workers = [Worker(i) for i in range(NUM_WORKERS)]
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_load(stub, w, stop)) for w in workers]
            deadline = time.monotonic() + LOAD_DEADLINE_S
            while sum(w.num_acked for w in workers) < MIN_ACKED and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            first.stop(signal.SIGKILL)  # mid-load: the workers have requests in flight
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        first.stop(signal.SIGKILL)
    assert sum(w.num_acked for w in workers) >= 50, "load did not get going"

    second = await asyncio.to_thread(start_server, database_url, tmp, "second")
    port = second.port
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await _wait_serving(ch)
            stub = pb_grpc.BlockManagerStub(ch)
            admin = pb_grpc.BlockManagerAdminStub(ch)
            nodes = (await admin.ListNodes(pb.ListNodesRequest())).nodes
            assert [(n.node_id, n.epoch, n.fenced) for n in nodes] == [("n1", reg.epoch, False)]
            live = {s.seq_id: s.num_tokens for s in (await admin.ListSequences(pb.ListSequencesRequest())).sequences}
            for w in workers:
                extra = _inflight_effect(w)
                for sid, tokens in w.acked.items():
                    allowed = {tokens, tokens + extra.get(sid, 0)}
                    if w.inflight is not None and w.inflight[0] == "free":
                        allowed.add(None)  # the in-flight Free may have committed before the kill
                    assert live.get(sid) in allowed, (sid, live.get(sid), tokens, w.inflight)
                for sid in w.freed:
                    assert sid not in live
            # acknowledged requests are answered from the journal, identically
            for w in workers:
                for kind, req, resp in w.responses[-3:]:
                    assert await _call(stub, kind, req) == resp
            # in-flight requests retried with their ids act exactly once
            for w in workers:
                if w.inflight is not None:
                    kind, req = w.inflight
                    await _call(stub, kind, req)
                    _account(w, kind, req)
            live = {s.seq_id: s.num_tokens for s in (await admin.ListSequences(pb.ListSequencesRequest())).sequences}
            expected = {sid: t for w in workers for sid, t in w.acked.items()}
            assert live == expected
            fsck = await admin.Fsck(pb.FsckRequest())
            assert fsck.ok, list(fsck.problems)
    finally:
        rc = second.stop()
    assert rc == 0


def _inflight_effect(w: Worker) -> dict[str, int]:
    """Tokens the in-flight op adds to its sequence if it did commit before the kill."""
    if w.inflight is None or w.inflight[0] != "append":
        return {}
    req = w.inflight[1]
    return {req.append_seq_ids[0]: 2}  # type: ignore[attr-defined]


async def test_sigkill_mid_load_sqlite(tmp_path: Path) -> None:
    await _crash_and_recover(f"sqlite:///{tmp_path / 'bm.db'}", tmp_path)


@pytest.mark.postgres
async def test_sigkill_mid_load_postgres(tmp_path: Path, fresh_postgres_url: str) -> None:
    await _crash_and_recover(fresh_postgres_url, tmp_path)
