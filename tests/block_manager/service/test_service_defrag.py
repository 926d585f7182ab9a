"""Defragmentation through the service: a plan's moves ride in the pool's next step (copy ops
in the PoolStep), it commits when the scheduler reports that step's Forward, aborts when it
reports it failed or never reports it (timeout); admin trigger; the policy runner; and the
defrag race: blocks whose Forward is not reported never move."""

from __future__ import annotations

from typing import Any

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, eventually, rid


async def _fragment(h: Harness) -> None:
    """Pool n1 with live, written full blocks above freed ones."""
    await h.register("n1", num_blocks=16)
    await h.step(allocs=[(f"s{i}", "n1", None, 4, None, 0) for i in range(6)])
    await h.free("s0", "s1", "s2")


async def _trigger(h: Harness, **kw: Any) -> pb.DefragPlan:
    plans = (await h.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id=rid(), pool_id="n1", **kw))).plans
    assert len(plans) == 1
    return plans[0]


async def test_steps_without_tokens_hand_out_no_pool_step(harness: Harness) -> None:
    """A Step of frees or reports alone (client.free, flush_reports) has no Forward to follow:
    it must not return the plan's PoolStep, or the node would never see those moves."""
    await _fragment(harness)
    await harness.allocate("extra", num_tokens=4)
    plan = await _trigger(harness)
    assert list((await harness.free("extra")).steps) == []
    assert list((await harness.flush()).steps) == []
    carrying = await harness.append(("s3", 1))
    (ps,) = carrying.steps
    assert ps.plan_id == plan.plan_id and len(ps.copy_src) == len(plan.moves)


async def test_moves_ride_in_the_next_step_and_commit_when_it_is_reported(harness: Harness) -> None:
    await _fragment(harness)
    before = {s: harness.table(s) for s in ("s3", "s4", "s5")}
    plan = await _trigger(harness)
    assert plan.kind == "compaction" and len(plan.moves) == 3
    assert all(m.kind == "defrag" and m.dst < m.src for m in plan.moves)
    carrying = await harness.append(("s3", 1))
    (ps,) = carrying.steps
    assert ps.plan_id == plan.plan_id and ps.step_id == plan.step_id
    assert [(s, d) for s, d, k in zip(ps.copy_src, ps.copy_dst, ps.copy_is_defrag) if k] == [
        (m.src, m.dst) for m in plan.moves
    ]
    # tables still point at the sources until the step's Forward is reported (s3 grew a block)
    assert {s: harness.table(s)[:1] for s in before} == before
    after = await harness.append(("s4", 1))
    assert list(after.settled[0].committed_plan_ids) == [plan.plan_id]
    moved = {m.src: m.dst for m in plan.moves}
    for sid, table in before.items():
        assert harness.table(sid)[:1] == tuple(moved.get(b, b) for b in table)
    # the rewrites reach the node in the same step as the first writes after the commit
    (ps,) = after.steps
    assert {"s3", "s4", "s5"} <= set(ps.delta_seq_ids)
    status = (await harness.admin.Status(pb.StatusRequest())).pools[0]
    assert status.defrag_moves == 3 and status.num_reserved_blocks == 0
    assert await harness.fsck() == []


async def test_unwritten_blocks_never_move(harness: Harness) -> None:
    """The race of issue 9: a plan made between a step's allocation and its Forward must not
    move the blocks that Forward is about to write."""
    await harness.register("n1", num_blocks=16)
    await harness.allocate("pad", num_tokens=8)
    await harness.allocate("new", num_tokens=8, forward=False)  # its Forward has not run
    await harness.free("pad")
    plans = (await harness.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id=rid(), pool_id="n1"))).plans
    assert list(plans) == []  # "new" sits above the hole, but its K/V is not written yet
    harness.reports["n1"] = (1, harness.server.runtime.state.core.open_step_id("n1") - 1, 0)  # type: ignore[union-attr]
    await harness.flush()
    plan = await _trigger(harness)
    assert {m.src for m in plan.moves} == set(harness.table("new"))
    assert await harness.fsck() == []


async def test_a_failed_step_aborts_its_plan(harness: Harness) -> None:
    await _fragment(harness)
    before = {s: harness.table(s) for s in ("s3", "s4", "s5")}
    plan = await _trigger(harness, kind="compaction")
    carrying = await harness.append(("s3", 1), forward=False)
    (ps,) = carrying.steps
    out = await harness.step(reports={"n1": (1, ps.step_id - 1, ps.step_id)})
    assert list(out.settled[0].aborted_plan_ids) == [plan.plan_id]
    assert list(out.settled[0].dropped_seq_ids) == ["s3"]  # it wrote in the failed step
    assert {s: harness.table(s) for s in ("s4", "s5")} == {s: before[s] for s in ("s4", "s5")}
    assert (await harness.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == 0
    assert await harness.fsck() == []


async def test_unreported_plan_times_out(start_server: Any) -> None:
    h: Harness = await start_server(defrag={"enabled": False, "timeout_s": 0.2})
    await _fragment(h)
    plan = await _trigger(h)
    assert (await h.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == len(plan.moves)

    async def released() -> bool:
        return (await h.admin.Status(pb.StatusRequest())).pools[0].num_reserved_blocks == 0

    await eventually(released)
    status = (await h.admin.Status(pb.StatusRequest())).pools[0]
    assert status.num_reserved_blocks == 0 and status.defrag_moves == 0
    assert h.server.defrag is not None and h.server.defrag.num_plans_timed_out == 1
    assert await h.fsck() == []


async def test_policy_runner_then_admin_trigger(start_server: Any) -> None:
    h: Harness = await start_server(
        defrag={"enabled": True, "check_every_steps": 2, "every_n_steps": 2, "min_contiguity": None}
    )
    await _fragment(h)
    state = h.server.runtime.state  # type: ignore[union-attr]

    async def planned() -> bool:
        await h.append(("s5", 1))  # scheduler steps: the policy check runs every second one
        return bool(state.outstanding_plans())

    await eventually(planned)
    (plan,) = state.outstanding_plans()
    assert plan.kind == "compaction"
    for _ in range(2):  # one step carries the moves, the next reports them: committed
        await h.append(("s5", 1))
    assert state.outstanding_plans() == [] and state.core.metrics("n1").defrag_moves == len(plan.moves)
    await h.free("s3")
    # a maximum-length request id: the per-pool ids the server journals are derived and bounded
    await h.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id="r" * 128))
    assert (await h.admin.Status(pb.StatusRequest())).state == "serving"
    assert await h.fsck() == []
