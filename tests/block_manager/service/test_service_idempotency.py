"""Request-id replay: the same id returns the recorded result and acts once; the same id with
another payload is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, expect_code, rid, step_request


async def num_tokens(h: Harness, seq_id: str) -> int:
    return (await h.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id=seq_id))).table.num_tokens


async def test_retry_returns_recorded_result_and_acts_once(harness: Harness) -> None:
    await harness.register("n1", num_blocks=32)
    req = step_request(request_id="alloc-1", allocs=[("a", "n1", None, 6, None, 0)])
    first = await harness.stub.Step(req)
    second = await harness.stub.Step(req)
    assert first == second and not first.errors  # not ALREADY_EXISTS on retry
    append = step_request(request_id="step-1", appends=[("a", 3)], reports={"n1": (1, 1, 0)})
    r1 = await harness.stub.Step(append)
    r2 = await harness.stub.Step(append)
    assert r1 == r2 and list(r1.steps[0].delta_seq_ids) == ["a"]
    assert await num_tokens(harness, "a") == 9  # appended once
    free = step_request(request_id="free-1", frees=["a"], reports={"n1": (1, 2, 0)})
    assert not (await harness.stub.Step(free)).errors
    assert not (await harness.stub.Step(free)).errors  # not a double free


async def test_same_id_different_payload_is_invalid_argument(harness: Harness) -> None:
    await harness.register("n1", num_blocks=32)
    await harness.stub.Step(step_request(request_id="dup", allocs=[("a", "n1", None, 6, None, 0)]))
    before = harness.state_snapshot()
    other = step_request(request_id="dup", allocs=[("b", "n1", None, 6, None, 0)])
    await expect_code(harness.stub.Step(other), grpc.StatusCode.INVALID_ARGUMENT)
    # the same id on another RPC is a different payload too
    await expect_code(
        harness.stub.RegisterNode(pb.RegisterNodeRequest(request_id="dup", node_id="n2", num_blocks=4)),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert harness.state_snapshot() == before


async def test_failed_request_is_not_recorded(harness: Harness) -> None:
    await harness.register("n1", num_blocks=32)
    req = step_request(request_id="free-early", frees=["late"])
    await expect_code(harness.stub.Step(req), grpc.StatusCode.NOT_FOUND)
    await harness.allocate("late", num_tokens=2)
    await harness.flush()
    assert not (await harness.stub.Step(req)).errors  # executed afresh, now succeeds


async def test_concurrent_duplicates_act_once(harness: Harness) -> None:
    await harness.register("n1", num_blocks=64)
    await harness.allocate("a", num_tokens=1)
    req = step_request(request_id="burst", appends=[("a", 4)])
    results = await asyncio.gather(*(harness.stub.Step(req) for _ in range(8)))
    assert all(r == results[0] for r in results)
    assert await num_tokens(harness, "a") == 5


async def test_register_retry_keeps_epoch(harness: Harness) -> None:
    req = pb.RegisterNodeRequest(request_id="reg-n1", node_id="n1", num_blocks=8)
    a = await harness.stub.RegisterNode(req)
    b = await harness.stub.RegisterNode(req)
    assert a.epoch == b.epoch == 1
    c = await harness.stub.RegisterNode(pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=8))
    assert c.epoch == 2


async def _steps(h: Harness, n: int) -> list[tuple[pb.StepRequest, pb.StepResponse]]:
    await h.register("n1", num_blocks=64)
    await h.step(allocs=[("a", "n1", None, 1, None, 0), ("b", "n1", None, 1, None, 0)])
    done = []
    last = 1
    for i in range(n):
        # not "step-{i}": `h.step` above names its request `rid("step")`, "step-<a process-wide
        # counter>", which would collide with one of these whenever the counter is below n
        req = step_request(request_id=f"old-{i}", appends=[("a", 1), ("b", 1)], reports={"n1": (1, last, 0)})
        resp = await h.stub.Step(req)
        last = resp.steps[0].step_id
        done.append((req, resp))
    return done


async def test_old_results_come_back_from_the_store(start_server: Any, tmp_path: Any) -> None:
    h: Harness = await start_server(database_url=f"sqlite:///{tmp_path / 'bm.db'}", max_retained_result_items=6)
    done = await _steps(h, 6)
    assert h.server.runtime is not None
    assert h.server.runtime._requests.get("old-0").result is None  # shed from memory
    for req, resp in done:
        assert await h.stub.Step(req) == resp
    assert await num_tokens(h, "a") == 7


async def test_old_results_without_a_store_are_refused_not_repeated(start_server: Any) -> None:
    h: Harness = await start_server(max_retained_result_items=6)
    done = await _steps(h, 6)
    req, _ = done[0]
    await expect_code(h.stub.Step(req), grpc.StatusCode.FAILED_PRECONDITION)
    req, resp = done[-1]
    assert await h.stub.Step(req) == resp
    assert await num_tokens(h, "a") == 7
