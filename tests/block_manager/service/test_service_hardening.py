"""The block manager never stops on a client's input (issue 10, items 1-4 and the echo limit).

Each test here failed on the starting commit of the `hardening` branch: a request id the
journal's column cannot hold crashed the server (fail-stop after the state was changed), a late
retry was applied a second time and then refused by the journal (crash), a client request id
shaped like the server's own ids blocked lease expiry and defrag timeouts, and an error detail
echoing a huge client id came back as RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from block_manager.core.errors import InvalidRequest
from block_manager.service.errors import RecordRejected
from block_manager.service.protocol import check_request_id
from block_manager.service.runtime import ServiceRuntime, internal_request_id
from block_manager.store import open_store
from block_manager.store.records import MAX_REQUEST_ID_LEN
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, eventually, expect_code, rid, step_request
from tests.support.configs import bm_test_config

StartServer = Callable[..., Any]


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'bm.db'}"


def _serving(h: Harness) -> bool:
    assert h.server.runtime is not None
    return h.server.runtime.phase == "serving" and not h.server.failed.is_set()


async def _num_tokens(h: Harness, seq_id: str) -> int:
    return (await h.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id=seq_id))).table.num_tokens


async def _fragmented_pool(h: Harness, node: str) -> None:
    """40 one-block sequences, every other one freed: a compaction plan has moves."""
    await h.register(node, num_blocks=64)
    for i in range(40):
        await h.allocate(f"s{i}", pool=node, num_tokens=4)
    await h.free(*[f"s{i}" for i in range(0, 40, 2)])   # reports the last Forward too


# ---- item 3: the server's own request ids ---------------------------------------------------
def test_internal_ids_are_outside_the_client_namespace_and_fit_the_journal() -> None:
    ids = [
        internal_request_id("expire", "victim", 1),
        internal_request_id("defrag-timeout", 7),
        internal_request_id("trigger", "r" * 128, "n" * 128),   # 266 characters verbatim
    ]
    for request_id in ids:
        with pytest.raises(InvalidRequest):
            check_request_id(request_id)
        assert 0 < len(request_id) <= MAX_REQUEST_ID_LEN
    assert internal_request_id("expire", "victim", 1) == ids[0]            # deterministic
    assert internal_request_id("trigger", "r" * 128, "n" * 127) != ids[2]   # hashed, still distinct
    assert internal_request_id("expire", "a:b", 1) != internal_request_id("expire", "a", "b:1")
    with pytest.raises(ValueError):
        internal_request_id("expire", "bad\x1fpart")


async def test_client_id_shaped_like_a_lease_expiry_does_not_stop_the_expiry(start_server: StartServer) -> None:
    h = await start_server(lease_ttl_s=0.5)
    await h.register("victim")
    request = step_request(allocs=[("live", "victim", None, 4, None, 0)], request_id="expire:victim:1")
    first = await h.stub.Step(request)
    assert not first.errors and list(first.alloc_num_tokens) == [4]
    # No heartbeat: the lease lapses, and the client's id must not stand in the way.
    await eventually(
        lambda: h.server.runtime.state.registry.get("victim").fenced, timeout_s=10, what="victim fenced"
    )
    assert list((await h.admin.ListSequences(pb.ListSequencesRequest())).sequences) == []
    # The client's request stays an ordinary recorded request.
    assert await h.stub.Step(request) == first


async def test_client_id_shaped_like_a_defrag_timeout_does_not_stop_the_abort(start_server: StartServer) -> None:
    h = await start_server(defrag={"enabled": False, "timeout_s": 0.5})
    await _fragmented_pool(h, "n1")
    plans = (await h.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id=rid(), pool_id="n1"))).plans
    assert len(plans) == 1 and plans[0].moves
    # the plan rides in this step, whose Forward is never reported
    await h.allocate("x", num_tokens=4, request_id=f"defrag-timeout:{plans[0].plan_id}", forward=False)
    runtime = h.server.runtime
    await eventually(lambda: not runtime.state.outstanding_plans(), timeout_s=10, what="plan aborted")
    assert h.server.defrag.num_plans_timed_out == 1
    assert await h.fsck() == []


# ---- item 1: TriggerDefrag with the longest ids a client may send -----------------------------
async def _trigger_with_max_length_ids(h: Harness) -> None:
    node = "n" * 128
    await _fragmented_pool(h, node)
    request = pb.TriggerDefragRequest(request_id="r" * 128, pool_id=node)
    plans = (await h.admin.TriggerDefrag(request)).plans
    assert len(plans) == 1 and plans[0].moves
    assert _serving(h)
    assert (await h.admin.TriggerDefrag(request)).plans == plans   # a retry: the recorded plan
    assert _serving(h)


async def test_trigger_defrag_with_max_length_ids_keeps_serving_sqlite(
    start_server: StartServer, tmp_path: Path
) -> None:
    await _trigger_with_max_length_ids(await start_server(database_url=_sqlite(tmp_path)))


@pytest.mark.postgres
async def test_trigger_defrag_with_max_length_ids_keeps_serving_postgres(
    start_server: StartServer, fresh_postgres_url: str
) -> None:
    await _trigger_with_max_length_ids(await start_server(database_url=fresh_postgres_url))


# ---- item 4: a record the journal cannot hold fails its request, not the process --------------
_REGISTER = {"node_id": "n1", "num_blocks": 8, "block_size": 4, "geometry": {}, "address": ""}


async def test_record_the_journal_cannot_hold_fails_only_its_request(tmp_path: Path) -> None:
    store = open_store(_sqlite(tmp_path))
    runtime = ServiceRuntime(bm_test_config(database_url=_sqlite(tmp_path)), store)
    await runtime.start()
    try:
        digest = hashlib.sha256(b"register").hexdigest()
        with pytest.raises(RecordRejected):   # one character longer than the journal's column
            await runtime.mutate("register_node", "x" * (MAX_REQUEST_ID_LEN + 1), digest, dict(_REGISTER))
        bad_payload = {**_REGISTER, "geometry": {"scale": float("nan")}}   # not JSON
        with pytest.raises(RecordRejected):
            await runtime.mutate("register_node", "ok-id", digest, bad_payload)
        assert runtime.phase == "serving" and not runtime.writer.failed
        assert runtime.state.core.pool_ids == []                            # nothing was applied
        # An internal id longer than the column is made to fit, journaled once, idempotent.
        long_internal = "defrag-timeout:" + "9" * 300
        first = await runtime.mutate("register_node", long_internal, digest, dict(_REGISTER), internal=True)
        again = await runtime.mutate("register_node", long_internal, digest, dict(_REGISTER), internal=True)
        assert again == first and runtime.state.registry.get("n1").epoch == 1
        assert runtime.phase == "serving" and not runtime.writer.failed
    finally:
        await runtime.close()
    reopened = open_store(_sqlite(tmp_path))
    try:
        assert [len(r.request_id) <= MAX_REQUEST_ID_LEN for r in reopened.retained_requests()] == [True]
    finally:
        reopened.close()


# ---- item 2: a late retry is answered, never applied again --------------------------------------
APPEND_X = step_request(appends=[("s", 1)], request_id="append-x")   # sent as is, retried as is


async def _append_then_others(h: Harness, num_others: int) -> pb.StepResponse:
    await h.register("n1", num_blocks=64)
    await h.allocate("s", num_tokens=3)
    first = await h.stub.Step(APPEND_X)
    assert not first.errors
    for i in range(num_others):
        await h.allocate(f"o{i}", num_tokens=1)
    return first


async def test_late_retry_is_answered_from_the_journal(start_server: StartServer, tmp_path: Path) -> None:
    h = await start_server(database_url=_sqlite(tmp_path), max_retained_requests=20, request_retention_s=2)
    first = await _append_then_others(h, 30)
    await asyncio.sleep(2.5)  # past the retention time of the original request
    assert await h.stub.Step(APPEND_X) == first
    assert await _num_tokens(h, "s") == 4 and _serving(h)
    assert await h.fsck() == []


async def test_retry_after_a_restart_is_answered_from_the_journal(start_server: StartServer, tmp_path: Path) -> None:
    settings = {"database_url": _sqlite(tmp_path), "max_retained_requests": 20, "request_retention_s": 2}
    h1 = await start_server(**settings)
    first = await _append_then_others(h1, 5)
    await h1.server.stop(0)   # the final snapshot covers every record; the journal keeps them
    h2 = await start_server(**settings)
    await asyncio.sleep(2.5)  # past the retention time, counted from the restart too
    assert await h2.stub.Step(APPEND_X) == first
    assert await _num_tokens(h2, "s") == 4 and _serving(h2)


async def test_retry_whose_result_is_gone_is_refused_as_expired(start_server: StartServer, tmp_path: Path) -> None:
    h = await start_server(
        database_url=_sqlite(tmp_path), max_retained_requests=20, request_retention_s=0.5,
        max_retained_result_items=1, snapshot_every_records=1,
    )
    await _append_then_others(h, 2)
    await asyncio.sleep(0.6)
    await h.allocate("later", num_tokens=1)   # its snapshot lets the store prune the old record by age
    writer = h.server.runtime.writer
    await eventually(lambda: writer.snapshot_seq_no == writer.last_seq_no, what="snapshot after the last record")
    err = await expect_code(h.stub.Step(APPEND_X), grpc.StatusCode.FAILED_PRECONDITION)
    assert "expired" in (err.details() or "")
    assert await _num_tokens(h, "s") == 4 and _serving(h)


# ---- protocol edges: echoed values are clipped --------------------------------------------------
async def test_huge_client_ids_come_back_in_short_messages(harness: Harness) -> None:
    err = await expect_code(
        harness.stub.Heartbeat(pb.HeartbeatRequest(node_id="a" * 20_000, epoch=1)), grpc.StatusCode.NOT_FOUND
    )
    assert len(err.details() or "") <= 1024
    err = await expect_code(
        harness.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="s" * 20_000)),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert len(err.details() or "") <= 1024
