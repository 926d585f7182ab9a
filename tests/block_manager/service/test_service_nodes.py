"""Epochs, leases, fencing and drain through the service."""

from __future__ import annotations

from typing import Any

import grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, expect_code, item_errors, rid, step_request
from tests.support.polling import eventually

FP = grpc.StatusCode.FAILED_PRECONDITION


async def test_reregistration_fences_old_epoch_and_reclaims(harness: Harness) -> None:
    old = await harness.register("n1", num_blocks=16)
    await harness.allocate("a", num_tokens=8)
    new = await harness.register("n1", num_blocks=16)
    assert new.epoch == old.epoch + 1
    await expect_code(harness.stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=old.epoch)), FP)
    await expect_code(harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=old.epoch)), FP)
    pinned = step_request(appends=[("a", 1)], pool_epochs={"n1": old.epoch})
    await expect_code(harness.stub.Step(pinned), FP)
    # the old epoch's sequence is gone; writes to it name the fencing
    out = item_errors(await harness.append(("a", 1)), "append")[0]
    assert out.code == FP.value[0] and out.reason == "NodeFenced"
    status = await harness.admin.Status(pb.StatusRequest())
    assert status.pools[0].num_used_blocks == 0
    # freeing it is no error (a scheduler learns of a fencing only after it frees): the Step
    # carrying that free goes through with the rest; a second free is a double free
    await harness.allocate("b", num_tokens=4)
    resp = await harness.step(frees=["a"], appends=[("b", 1)])
    assert not resp.errors and list(resp.append_num_tokens) == [5]
    await expect_code(harness.free("a"), FP)
    assert await harness.fsck() == []


async def test_lease_expiry_fences_and_reclaims_blocks(start_server: Any) -> None:
    h: Harness = await start_server(lease_ttl_s=0.6)
    reg = await h.register("n1", num_blocks=16)
    keep = await h.register("n2", num_blocks=16)
    await h.allocate("a", pool="n1", num_tokens=8)
    await h.allocate("b", pool="n2", num_tokens=8)
    # n2 heartbeats, n1 does not; the expiry timer fences n1 about 0.6 s in
    async def fenced_n1() -> dict[str, pb.NodeInfo] | None:
        await h.stub.Heartbeat(pb.HeartbeatRequest(node_id="n2", epoch=keep.epoch))
        nodes = {n.node_id: n for n in (await h.admin.ListNodes(pb.ListNodesRequest())).nodes}
        return nodes if nodes["n1"].fenced else None

    nodes = await eventually(fenced_n1, interval_s=0.05, what="n1 fenced")
    assert nodes["n1"].fenced and not nodes["n2"].fenced
    assert nodes["n2"].lease_remaining_s > 0
    await expect_code(h.stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=reg.epoch)), FP)
    out = item_errors(await h.allocate("c", pool="n1", num_tokens=1), "alloc")[0]
    assert out.code == FP.value[0] and out.reason == "NodeFenced"
    status = await h.admin.Status(pb.StatusRequest())
    assert [p.pool_id for p in status.pools] == ["n2"] and status.num_sequences == 1
    # the fenced node comes back with a new epoch and an empty pool
    back = await h.register("n1", num_blocks=16)
    assert back.epoch == reg.epoch + 1
    assert not (await h.allocate("c", pool="n1", num_tokens=1)).errors
    assert await h.fsck() == []


async def test_drain_node_refuses_new_sequences_only(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.register("n2", num_blocks=16)
    await harness.allocate("a", num_tokens=4)
    resp = await harness.admin.DrainNode(pb.DrainNodeRequest(request_id=rid(), node_id="n1"))
    assert resp.num_sequences == 1
    out = item_errors(await harness.allocate("b", num_tokens=4), "alloc")[0]
    assert out.code == FP.value[0] and out.reason == "PoolDraining"
    fork = item_errors(await harness.fork("a", "a1"), "fork")[0]  # a fork is a new sequence too
    assert fork.code == FP.value[0] and fork.reason == "PoolDraining"
    assert not (await harness.append(("a", 4))).errors
    routes = (await harness.stub.Route(pb.RouteRequest(token_ids=[1, 2, 3]))).entries
    assert [e.pool_id for e in routes] == ["n2"]
    reg = (await harness.admin.ListNodes(pb.ListNodesRequest())).nodes[0]
    assert reg.draining
    hb = await harness.stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=reg.epoch))
    assert hb.draining
    await harness.admin.DrainNode(pb.DrainNodeRequest(request_id=rid(), node_id="n1", undrain=True))
    assert not (await harness.allocate("b", num_tokens=4)).errors
    await expect_code(
        harness.admin.DrainNode(pb.DrainNodeRequest(request_id=rid(), node_id="zz")), grpc.StatusCode.NOT_FOUND
    )
