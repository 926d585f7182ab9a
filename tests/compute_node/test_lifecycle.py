"""Restarts and fencing: block manager restart mid-workload, node restart, a fenced epoch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from block_manager.client import ItemFailure, UnavailableError
from compute_node.client import build_request
from pagedkv.v1 import block_manager_pb2 as bm_pb
from tests.compute_node.harness import BLOCK_SIZE, Scheduler, rid, start_bm, start_node
from tests.support.polling import eventually


def _sample(node, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    """A metric as the node exports it (prometheus_client's public registry API)."""
    return node.node.metrics.registry.get_sample_value(name, labels) or 0.0


def _heartbeats(node) -> float:  # type: ignore[no-untyped-def]
    return _sample(node, "pagedkv_cn_block_manager_rpcs_total", rpc="Heartbeat")


async def test_block_manager_restart_mid_workload(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bm.db'}"
    bm = await start_bm(database_url=url, lease_ttl_s=1.5)
    port = bm.port
    node = await start_node(bm.address)
    s = Scheduler(bm.address, node.address, "node-a", seed=3)
    try:
        await s.forward([await s.allocate("a", list(range(6))), await s.allocate("b", list(range(20, 29)))])
        for _ in range(3):
            await s.forward(await s.append(["a", "b"]))
        # 10th token of a: inside its last block (answered by the client); 13th of b: a new
        # block (a Step RPC). Both steps are in hand before the block manager goes down.
        steps = await s.append(["a", "b"])
        await bm.stop(0)
        # Block manager down: Forwards of steps in hand need nothing from it ...
        await s.forward(steps)
        assert s.last_stats.num_block_manager_rpcs == 0
        await s.forward(await s.append(["a", "b"]))            # in-block decode: no RPC at all
        # ... a step that needs it fails retryably on the scheduler side ...
        with pytest.raises(UnavailableError):
            await s.allocate("c", [7, 7, 7])
        # ... and the heartbeat keeps failing without fencing the node.
        await eventually(
            lambda: _sample(node, "pagedkv_cn_block_manager_failures_total", rpc="Heartbeat") >= 1, timeout_s=5.0
        )

        bm = await start_bm(database_url=url, lease_ttl_s=1.5, listen_address=f"127.0.0.1:{port}")
        beats = _heartbeats(node)
        await eventually(lambda: _heartbeats(node) > beats, timeout_s=5.0)
        assert node.node.epoch == 1                       # same epoch: nothing was fenced
        # The scheduler's channel saw the outage (the refused allocate) and may sit in gRPC's
        # reconnect backoff longer than its client retries: the node's heartbeat getting through
        # says nothing about it. Wait for its own connection, as a scheduler's health check would.
        await asyncio.wait_for(s.client._channel.channel_ready(), timeout=30)
        # The recovered block manager has every acknowledged step; the pending reports and the
        # deferred in-block tokens go with the next step, and the workload goes on.
        for _ in range(6):
            await s.forward(await s.append(["a", "b"]))
        await s.forward([await s.allocate("c", [7, 7, 7])])
        assert s.last_stats.num_block_manager_rpcs == 0
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_cold_table_fetch(cluster) -> None:  # type: ignore[no-untyped-def]
    """A Forward naming a sequence whose step it does not carry: the node fetches the table
    (the cold path) only when the block manager's tables reflect the node's last step."""
    s = cluster.sched
    step = await s.allocate("a", [1, 2, 3])
    request = build_request([s.seq_input(step)], [0, 1])     # the admitting step left out
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(request)
    assert info.value.code() == grpc.StatusCode.ABORTED      # tables reflect step 1, the node has 0
    await cluster.bm.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(request)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert cluster.node.node.epoch == 1
    await s.forward([step])                                   # with its step: no block manager needed


async def test_node_restart_drops_old_sequences(cluster) -> None:  # type: ignore[no-untyped-def]
    s = cluster.sched
    await s.forward([await s.allocate("old", list(range(9)))])
    old_step = (await s.append(["old"]))[0]                 # 10th token: in-block, no RPC
    await cluster.node.stop(0)

    cluster.node = await start_node(cluster.bm.address)     # same node id: epoch 2, empty pool
    assert cluster.node.node.epoch == 2
    await s.node_channel.close()
    s.connect_node(cluster.node.address)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(s.request([old_step]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    step = s.client.step()
    step.append("old", num_new_tokens=BLOCK_SIZE)            # crosses a block: the server answers
    res = await step.commit()
    assert isinstance(res.appends["old"], ItemFailure)      # the block manager dropped it too
    del s.seqs["old"]
    await s.forward([await s.allocate("new", list(range(9)))])
    await s.forward(await s.append(["new"]))


async def _register_behind_nodes_back(s: Scheduler) -> int:
    reply = await s.bm.RegisterNode(
        bm_pb.RegisterNodeRequest(
            request_id=rid("reg"), node_id="node-a", num_blocks=64, block_size=4,
            geometry=bm_pb.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", device="cpu"),
        )
    )
    return int(reply.epoch)


async def test_fencing_found_by_a_forward(cluster) -> None:  # type: ignore[no-untyped-def]
    s = cluster.sched
    await s.forward([await s.allocate("old", list(range(5)))])
    assert await _register_behind_nodes_back(s) == 2       # fences epoch 1 (lease 30 s: no beat soon)
    step = await s.allocate("fresh", [4, 4, 4])             # lands in epoch 2's pool
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(s.request([step]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    node = cluster.node.node
    assert node.epoch == 3 and len(node.tables) == 0        # re-registered, cache dropped
    s.delivered(ok=False)                                   # moot: that epoch is gone too
    for seq_id in ("old", "fresh"):                         # both epochs' sequences are gone
        del s.seqs[seq_id]
    await s.forward([await s.allocate("after", [1, 2, 3, 4, 5])])


async def test_fencing_found_by_the_heartbeat() -> None:
    bm = await start_bm(lease_ttl_s=1.5)
    node = await start_node(bm.address)
    s = Scheduler(bm.address, node.address, "node-a")
    try:
        await s.forward([await s.allocate("old", list(range(5)))])
        await _register_behind_nodes_back(s)
        await eventually(lambda: node.node.epoch == 3, timeout_s=5.0)   # beat → FAILED_PRECONDITION → register
        request = s.request([s.new_step("old", 1)])
        del s.seqs["old"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(request)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await s.forward([await s.allocate("after", [1, 2, 3])])
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)
