"""Crash recovery under pipelined Steps: a real server process is SIGKILLed while every client
keeps several Steps in flight, each naming the one before it (`ClientSession.after`). After a
restart on the same database no acknowledged Step is lost, what was applied is a prefix of each
client's numbers (never a later Step without an earlier one), the Steps in flight at the kill,
resent in order, are each applied exactly once (answered from the journal when they had been
applied), a second resend gets the same answer byte for byte, and fsck is clean."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import step_request
from tests.block_manager.service.test_service_recovery import _wait_serving, start_server

NUM_CLIENTS = 4
DEPTH = 3                # Steps in flight per client
MIN_ACKED = 200          # kill once this many Steps were acknowledged ...
LOAD_DEADLINE_S = 30.0   # ... or after this long
LAST_STEP = [0]


@dataclass
class Client:
    cid: int
    session_id: str = ""
    num_sent: int = 1                  # numbers 1..num_sent were sent (1: the allocation)
    acked: set[int] = field(default_factory=set)
    sent: dict[int, pb.StepRequest] = field(default_factory=dict)

    @property
    def seq_id(self) -> str:
        return f"c{self.cid}"


def _request(c: Client, number: int) -> pb.StepRequest:
    """Number 1 allocates the client's sequence (3 tokens), every later one appends a token."""
    if number == 1:
        req = step_request(request_id=f"{c.seq_id}-1", allocs=[(c.seq_id, "n1", [1, 2, 3], 0, None, 0)])
    else:
        req = step_request(request_id=f"{c.seq_id}-{number}", reports={"n1": (1, LAST_STEP[0], 0)},
                           appends=[(c.seq_id, 1, [number % 1000])])
    req.session.session_id, req.session.seq = c.session_id, number
    req.session.after = number - 1
    return req


async def _load(stub: pb_grpc.BlockManagerStub, c: Client, stop: asyncio.Event) -> None:
    c.session_id = (await stub.OpenSession(pb.OpenSessionRequest(client_name=c.seq_id))).session_id
    in_flight: deque[tuple[int, pb.StepRequest, asyncio.Future[pb.StepResponse]]] = deque()
    number = 0
    try:
        while True:
            while len(in_flight) < DEPTH and not stop.is_set():
                number += 1
                req = _request(c, number)
                req.session.acked = in_flight[0][0] if in_flight else number
                c.num_sent = number
                c.sent[number] = req
                in_flight.append((number, req, asyncio.ensure_future(stub.Step(req, timeout=10))))
            if not in_flight:
                return
            n, req, call = in_flight.popleft()
            resp = await call
            assert not resp.errors, resp.errors
            for ps in resp.steps:
                LAST_STEP[0] = max(LAST_STEP[0], ps.step_id)
            c.acked.add(n)
    except grpc.aio.AioRpcError:
        for _, _, call in in_flight:
            call.cancel()


async def test_sigkill_under_pipelined_load_loses_no_acknowledged_step(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bm.db'}"
    LAST_STEP[0] = 0
    first = await asyncio.to_thread(start_server, url, tmp_path, "first")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as ch:
            await _wait_serving(ch)
            stub = pb_grpc.BlockManagerStub(ch)
            await stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg-n1", node_id="n1", num_blocks=8192))
            clients = [Client(i) for i in range(NUM_CLIENTS)]
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_load(stub, c, stop)) for c in clients]
            deadline = time.monotonic() + LOAD_DEADLINE_S
            while sum(len(c.acked) for c in clients) < MIN_ACKED and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            first.stop(signal.SIGKILL)   # mid-load: every client has Steps in flight
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        first.stop(signal.SIGKILL)
    assert sum(len(c.acked) for c in clients) >= 50, "load did not get going"

    second = await asyncio.to_thread(start_server, url, tmp_path, "second")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as ch:
            await _wait_serving(ch)
            stub = pb_grpc.BlockManagerStub(ch)
            admin = pb_grpc.BlockManagerAdminStub(ch)
            live = {s.seq_id: s.num_tokens for s in (await admin.ListSequences(pb.ListSequencesRequest())).sequences}
            for c in clients:
                # numbers applied: the allocation (3 tokens), then a token each
                applied = live[c.seq_id] - 3 + 1 if c.seq_id in live else 0
                # nothing acknowledged is lost; nothing is applied that was not sent
                top = max(c.acked, default=0)
                assert top <= applied <= c.num_sent, (c.seq_id, sorted(c.acked)[-5:], applied, c.num_sent)
                # the Steps in flight at the kill, resent in order: each applied exactly once
                last = None
                for n in range(top + 1, c.num_sent + 1):
                    last = await stub.Step(c.sent[n], timeout=10)
                    assert not last.errors
                if last is not None:   # answered from the record now, byte for byte
                    again = await stub.Step(c.sent[c.num_sent], timeout=10)
                    assert again.SerializeToString(deterministic=True) == last.SerializeToString(deterministic=True)
            after = {s.seq_id: s.num_tokens for s in (await admin.ListSequences(pb.ListSequencesRequest())).sequences}
            assert after == {c.seq_id: 3 + c.num_sent - 1 for c in clients}
            fsck = await admin.Fsck(pb.FsckRequest())
            assert fsck.ok, list(fsck.problems)
    finally:
        rc = second.stop()
    assert rc == 0
