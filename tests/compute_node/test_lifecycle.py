"""Restarts and fencing: block manager restart mid-workload, node restart, a fenced epoch."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pagedkv.v1 import block_manager_pb2 as bm_pb
from tests.compute_node.harness import Scheduler, rid, start_bm, start_node
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

        a_step = (await s.append(["a"]))[0]      # 10th token: inside a's last block
        b_step = (await s.append(["b"]))[0]      # 13th token: b gets a new block (new version)
        await bm.stop(0)
        # Block manager down: a step that needs no table is still served from the cache ...
        await s.forward([a_step])
        assert s.last_stats.num_block_manager_rpcs == 0
        # ... one that needs a newer table fails retryably and writes nothing ...
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(s.request([b_step]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # ... and the heartbeat keeps failing without fencing the node.
        await eventually(
            lambda: _sample(node, "pagedkv_cn_block_manager_failures_total", rpc="Heartbeat") >= 1, timeout_s=5.0
        )

        bm = await start_bm(database_url=url, lease_ttl_s=1.5, listen_address=f"127.0.0.1:{port}")
        beats = _heartbeats(node)
        await eventually(lambda: _heartbeats(node) > beats, timeout_s=5.0)
        assert node.node.epoch == 1                       # same epoch: nothing was fenced
        await s.bm_channel.close()
        s.connect_bm(bm.address)
        await s.forward([b_step])                         # the retry succeeds after recovery
        for _ in range(6):                                # recovered tables, new blocks, same KV
            await s.forward(await s.append(["a", "b"]))
        await s.forward([await s.allocate("c", [7, 7, 7])])
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_table_fetch_while_block_manager_down_is_unavailable(cluster) -> None:  # type: ignore[no-untyped-def]
    s = cluster.sched
    step = await s.allocate("a", [1, 2, 3])
    await cluster.bm.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(s.request([step]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert cluster.node.node.epoch == 1


async def test_node_restart_drops_old_sequences(cluster) -> None:  # type: ignore[no-untyped-def]
    s = cluster.sched
    await s.forward([await s.allocate("old", list(range(9)))])
    old_step = (await s.append(["old"]))[0]
    await cluster.node.stop(0)

    cluster.node = await start_node(cluster.bm.address)     # same node id: epoch 2, empty pool
    assert cluster.node.node.epoch == 2
    await s.node_channel.close()
    s.node_channel = grpc.aio.insecure_channel(cluster.node.address)
    from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

    s.node = pb_grpc.ComputeNodeStub(s.node_channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(s.request([old_step]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    resp = await s.bm.AppendSlots(
        bm_pb.AppendSlotsRequest(request_id=rid("app"), items=[bm_pb.AppendItem(seq_id="old", num_new_tokens=1)])
    )
    assert resp.outcomes[0].HasField("error")             # the block manager dropped it too
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
        request = s.request([s._new_step("old", [s.seqs["old"].num_tokens])])
        del s.seqs["old"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(request)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await s.forward([await s.allocate("after", [1, 2, 3])])
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)

