"""Defragmentation through the service: plan → copy ops to the node → ack commits;
manual commit/abort; timeout abort; admin trigger; the policy runner."""

from __future__ import annotations

from typing import Any

import grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, eventually, expect_code, rid


async def _fragment(h: Harness) -> int:
    """Pool n1 with live full blocks above freed ones; returns the node epoch."""
    reg = await h.register("n1", num_blocks=16)
    for i in range(6):
        await h.allocate(f"s{i}", num_tokens=4)
    await h.stub.Free(pb.FreeRequest(request_id=rid(), seq_ids=["s0", "s1", "s2"]))
    return reg.epoch


async def _tables(h: Harness, epoch: int) -> pb.GetTablesResponse:
    return await h.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=epoch, seq_ids=["s3", "s4", "s5"]))


async def test_plan_delivered_as_copy_ops_and_committed_by_ack(harness: Harness) -> None:
    epoch = await _fragment(harness)
    before = {t.seq_id: (list(t.block_table), t.version) for t in (await _tables(harness, epoch)).tables}
    plan = (await harness.stub.PlanDefrag(pb.PlanDefragRequest(request_id=rid(), pool_id="n1"))).plan
    assert plan.kind == "compaction" and len(plan.moves) == 3
    assert all(m.kind == "defrag" and m.dst < m.src for m in plan.moves)
    pending = await _tables(harness, epoch)
    assert [o.op_id for o in pending.copy_ops] == [m.op_id for m in plan.moves]
    # tables still point at the sources until the node acknowledged the copies
    assert {t.seq_id: (list(t.block_table), t.version) for t in pending.tables} == before
    await expect_code(
        harness.stub.CommitDefrag(pb.CommitDefragRequest(request_id=rid(), plan_id=plan.plan_id)),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    await expect_code(
        harness.stub.PlanDefrag(pb.PlanDefragRequest(request_id=rid(), pool_id="n1")),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    ack = await harness.stub.AckCopyOps(
        pb.AckCopyOpsRequest(request_id=rid(), node_id="n1", epoch=epoch, up_to_op_id=plan.moves[-1].op_id)
    )
    assert list(ack.committed_plan_ids) == [plan.plan_id]
    after = {t.seq_id: (list(t.block_table), t.version) for t in (await _tables(harness, epoch)).tables}
    moved = {m.src: m.dst for m in plan.moves}
    for sid, (table, version) in before.items():
        assert after[sid][0] == [moved.get(b, b) for b in table]
        if any(b in moved for b in table):
            assert after[sid][1] > version  # the table changed: a newer version
        else:
            assert after[sid][1] == version
    status = (await harness.admin.Status(pb.StatusRequest())).pools[0]
    assert status.high_water_mark == 3 and status.defrag_moves == 3
    assert await harness.fsck() == []


async def test_abort_and_unknown_plans(harness: Harness) -> None:
    await _fragment(harness)
    plan = (await harness.stub.PlanDefrag(pb.PlanDefragRequest(request_id=rid(), pool_id="n1", max_moves=1))).plan
    assert len(plan.moves) == 1
    assert (await harness.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == 1
    await harness.stub.AbortDefrag(pb.AbortDefragRequest(request_id=rid(), plan_id=plan.plan_id))
    assert (await harness.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == 0
    await expect_code(
        harness.stub.AbortDefrag(pb.AbortDefragRequest(request_id=rid(), plan_id=plan.plan_id)),
        grpc.StatusCode.NOT_FOUND,
    )
    await expect_code(
        harness.stub.PlanDefrag(pb.PlanDefragRequest(request_id=rid(), pool_id="n1", kind="shuffle")),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    await expect_code(
        harness.stub.PlanDefrag(pb.PlanDefragRequest(request_id=rid(), pool_id="zz")), grpc.StatusCode.NOT_FOUND
    )
    assert await harness.fsck() == []


async def test_unacknowledged_plan_times_out(start_server: Any) -> None:
    h: Harness = await start_server(defrag={"enabled": False, "timeout_s": 0.2})
    await _fragment(h)
    plan = (await h.stub.PlanDefrag(pb.PlanDefragRequest(request_id=rid(), pool_id="n1"))).plan
    assert (await h.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == len(plan.moves)

    async def released() -> bool:
        return (await h.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == 0

    await eventually(released)
    status = (await h.admin.Status(pb.StatusRequest())).pools[0]
    assert status.num_reserved_blocks == 0 and status.defrag_moves == 0
    await expect_code(
        h.stub.CommitDefrag(pb.CommitDefragRequest(request_id=rid(), plan_id=plan.plan_id)), grpc.StatusCode.NOT_FOUND
    )
    assert h.server.defrag is not None and h.server.defrag.num_plans_timed_out == 1
    assert await h.fsck() == []


async def test_admin_trigger_and_policy_runner(start_server: Any) -> None:
    h: Harness = await start_server(
        defrag={"enabled": True, "check_every_steps": 2, "every_n_steps": 2, "min_contiguity": None}
    )
    await _fragment(h)
    plans = (await h.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id=rid()))).plans
    assert [p.pool_id for p in plans] == ["n1"]
    await h.stub.AbortDefrag(pb.AbortDefragRequest(request_id=rid(), plan_id=plans[0].plan_id))
    # two scheduler steps later the policy plans a compaction on its own
    for _ in range(2):
        await h.append(("s3", 1))

    async def planned() -> bool:
        return (await h.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks > 0

    await eventually(planned)
    assert h.server.runtime is not None
    outstanding = h.server.runtime.state.outstanding_plans()
    assert len(outstanding) == 1 and outstanding[0].kind == "compaction"
