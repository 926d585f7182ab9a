"""Pipelined Steps (`ClientSession.after`): a request is applied only after its predecessor in
the session, whatever order the server receives them in; it is refused (FAILED_PRECONDITION,
never applied) when the predecessor was refused or does not arrive; a predecessor that was
answered without a journal record (it changed nothing) releases it too; on a durable server
the successor is journaled after its predecessor."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from block_manager.store.records import Packed, decode_body
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, expect_code, step_request


def _stamped(req: pb.StepRequest, sid: str, seq: int, after: int = 0) -> pb.StepRequest:
    req.session.session_id, req.session.seq, req.session.after = sid, seq, after
    return req


async def _session(h: Harness) -> str:
    return (await h.stub.OpenSession(pb.OpenSessionRequest(client_name="pipe"))).session_id


async def _started(h: Harness, sid: str) -> None:
    await h.register("n1", num_blocks=64)
    assert not (await h.stub.Step(_stamped(step_request(allocs=[("a", "n1", [1, 2, 3], 0, None, 0)]), sid, 1))).errors


async def test_a_successor_that_arrives_first_waits_for_its_predecessor(
    start_server: Callable[..., Any], tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'bm.db'}"
    h: Harness = await start_server(database_url=url)
    sid = await _session(h)
    await _started(h, sid)
    # number 3 appends to `b`, which number 2 allocates: sent first, it must wait for 2
    third = asyncio.ensure_future(h.stub.Step(_stamped(step_request(appends=[("b", 2, [7, 8])]), sid, 3, after=2)))
    await asyncio.sleep(0.2)
    assert not third.done()
    second = await h.stub.Step(_stamped(step_request(allocs=[("b", "n1", [4, 5], 0, None, 0)]), sid, 2, after=1))
    assert not second.errors and not (await third).errors
    assert (await third).append_num_tokens[0] == 4
    # journaled in the order applied: 2 before 3
    con = sqlite3.connect(tmp_path / "bm.db")
    rows = con.execute("SELECT request_id, payload FROM journal ORDER BY seq_no").fetchall()
    con.close()
    numbers = [r[0].rsplit("\x1f", 1)[-1] for r in rows if "\x1fsession\x1f" in r[0]]
    assert numbers == ["1", "2", "3"]
    assert all(isinstance(decode_body(p), Packed) for rid, p in rows if "\x1fsession\x1f" in rid)


async def test_a_refused_predecessor_fails_its_successors(start_server: Callable[..., Any]) -> None:
    h: Harness = await start_server()
    sid = await _session(h)
    await _started(h, sid)
    bad = step_request(appends=[("a", 2, [1])])   # 1 token id for 2 tokens: refused as a whole
    await expect_code(h.stub.Step(_stamped(bad, sid, 2, after=1)), grpc.StatusCode.INVALID_ARGUMENT)
    third = _stamped(step_request(allocs=[("c", "n1", [9], 0, None, 0)]), sid, 3, after=2)
    err = await expect_code(h.stub.Step(third), grpc.StatusCode.FAILED_PRECONDITION)
    assert "predecessor 2 failed" in (err.details() or "")
    fourth = _stamped(step_request(allocs=[("d", "n1", [9], 0, None, 0)]), sid, 4, after=3)
    await expect_code(h.stub.Step(fourth), grpc.StatusCode.FAILED_PRECONDITION)   # and so on down the line
    runtime = h.server.runtime
    assert runtime is not None
    assert not runtime.state.core.has_sequence("c") and not runtime.state.core.has_sequence("d")


async def test_a_missing_predecessor_refuses_after_the_wait(start_server: Callable[..., Any]) -> None:
    h: Harness = await start_server()
    runtime = h.server.runtime
    assert runtime is not None
    runtime.sessions.pipeline_wait_s = 0.2
    sid = await _session(h)
    await _started(h, sid)
    late = _stamped(step_request(allocs=[("c", "n1", [9], 0, None, 0)]), sid, 3, after=2)   # 2 never comes
    err = await expect_code(h.stub.Step(late), grpc.StatusCode.FAILED_PRECONDITION)
    assert "did not arrive" in (err.details() or "")
    assert not runtime.state.core.has_sequence("c")


async def test_an_answer_that_changed_nothing_releases_its_successor(start_server: Callable[..., Any]) -> None:
    h: Harness = await start_server(database_url="memory://")
    sid = await _session(h)
    await _started(h, sid)
    # every item of number 2 fails on its own (unknown sequence): answered, not journaled
    nothing = await h.stub.Step(_stamped(step_request(appends=[("zz", 1, [1])], reports={}), sid, 2, after=1))
    assert nothing.errors
    after = await h.stub.Step(_stamped(step_request(appends=[("a", 1, [4])]), sid, 3, after=2))
    assert not after.errors


async def test_after_must_name_an_earlier_number(start_server: Callable[..., Any]) -> None:
    h: Harness = await start_server()
    sid = await _session(h)
    await _started(h, sid)
    await expect_code(h.stub.Step(_stamped(step_request(), sid, 2, after=2)), grpc.StatusCode.INVALID_ARGUMENT)
