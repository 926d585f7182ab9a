"""Request-id replay: the same id returns the recorded result and acts once; the same id
with another payload is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, expect_code, rid


async def test_retry_returns_recorded_result_and_acts_once(harness: Harness) -> None:
    await harness.register("n1", num_blocks=32)
    req = pb.AllocateRequest(request_id="alloc-1", items=[pb.AllocateItem(seq_id="a", pool_id="n1", num_tokens=6)])
    first = await harness.stub.Allocate(req)
    second = await harness.stub.Allocate(req)
    assert first == second
    assert first.outcomes[0].WhichOneof("outcome") == "allocation"  # not ALREADY_EXISTS on retry

    append = pb.AppendSlotsRequest(request_id="step-1", items=[pb.AppendItem(seq_id="a", num_new_tokens=3)])
    r1 = await harness.stub.AppendSlots(append)
    r2 = await harness.stub.AppendSlots(append)
    assert r1 == r2
    table = (await harness.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="a"))).table
    assert table.num_tokens == 9  # appended once

    free = pb.FreeRequest(request_id="free-1", seq_ids=["a"])
    assert (await harness.stub.Free(free)).num_freed == 1
    assert (await harness.stub.Free(free)).num_freed == 1  # not a double free


async def test_same_id_different_payload_is_invalid_argument(harness: Harness) -> None:
    await harness.register("n1", num_blocks=32)
    await harness.stub.Allocate(
        pb.AllocateRequest(request_id="dup", items=[pb.AllocateItem(seq_id="a", pool_id="n1", num_tokens=6)])
    )
    before = harness.state_snapshot()
    other = pb.AllocateRequest(request_id="dup", items=[pb.AllocateItem(seq_id="b", pool_id="n1", num_tokens=6)])
    await expect_code(harness.stub.Allocate(other), grpc.StatusCode.INVALID_ARGUMENT)
    # the same id on another RPC is a different payload too
    await expect_code(
        harness.stub.Free(pb.FreeRequest(request_id="dup", seq_ids=["a"])), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert harness.state_snapshot() == before


async def test_failed_request_is_not_recorded(harness: Harness) -> None:
    await harness.register("n1", num_blocks=32)
    req = pb.FreeRequest(request_id="free-early", seq_ids=["late"])
    await expect_code(harness.stub.Free(req), grpc.StatusCode.NOT_FOUND)
    await harness.allocate("late", num_tokens=2)
    assert (await harness.stub.Free(req)).num_freed == 1  # executed afresh, now succeeds


async def test_concurrent_duplicates_act_once(harness: Harness) -> None:
    await harness.register("n1", num_blocks=64)
    await harness.allocate("a", num_tokens=1)
    req = pb.AppendSlotsRequest(request_id="burst", items=[pb.AppendItem(seq_id="a", num_new_tokens=4)])
    results = await asyncio.gather(*(harness.stub.AppendSlots(req) for _ in range(8)))
    assert all(r == results[0] for r in results)
    table = (await harness.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="a"))).table
    assert table.num_tokens == 5


async def test_register_retry_keeps_epoch(harness: Harness) -> None:
    req = pb.RegisterNodeRequest(request_id="reg-n1", node_id="n1", num_blocks=8)
    a = await harness.stub.RegisterNode(req)
    b = await harness.stub.RegisterNode(req)
    assert a.epoch == b.epoch == 1
    c = await harness.stub.RegisterNode(pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=8))
    assert c.epoch == 2


async def _steps(h: Harness, n: int) -> list[tuple[pb.AppendSlotsRequest, pb.AppendSlotsResponse]]:
    await h.register("n1", num_blocks=64)
    await h.allocate("a", num_tokens=1)
    await h.allocate("b", num_tokens=1)
    done = []
    for i in range(n):
        req = pb.AppendSlotsRequest(
            request_id=f"step-{i}",
            items=[pb.AppendItem(seq_id="a", num_new_tokens=1), pb.AppendItem(seq_id="b", num_new_tokens=1)],
        )
        done.append((req, await h.stub.AppendSlots(req)))
    return done


async def test_old_results_come_back_from_the_store(start_server: Any, tmp_path: Any) -> None:
    h: Harness = await start_server(database_url=f"sqlite:///{tmp_path / 'bm.db'}", max_retained_result_items=6)
    done = await _steps(h, 6)
    assert h.server.runtime is not None
    assert h.server.runtime._requests.get("step-0").result is None  # shed from memory
    for req, resp in done:
        assert await h.stub.AppendSlots(req) == resp
    table = (await h.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="a"))).table
    assert table.num_tokens == 7


async def test_old_results_without_a_store_are_refused_not_repeated(start_server: Any) -> None:
    h: Harness = await start_server(max_retained_result_items=6)
    done = await _steps(h, 6)
    req, _ = done[0]
    await expect_code(h.stub.AppendSlots(req), grpc.StatusCode.FAILED_PRECONDITION)
    req, resp = done[-1]
    assert await h.stub.AppendSlots(req) == resp
    table = (await h.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="a"))).table
    assert table.num_tokens == 7
