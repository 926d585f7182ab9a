"""Admin plane, admin token, health, reflection and the metrics endpoint."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, eventually, expect_code, rid


async def test_status_list_describe(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.register("n2", num_blocks=8)
    for i in range(3):
        await harness.allocate(f"s{i}", num_tokens=5)
    status = await harness.admin.Status(pb.StatusRequest())
    assert (status.state, status.num_nodes, status.num_sequences, status.store) == ("serving", 2, 3, "memory")
    assert status.last_seq_no == 5
    pool = {p.pool_id: p for p in status.pools}["n1"]
    assert (pool.num_used_blocks, pool.num_tokens, pool.waste_slots) == (6, 15, 9)
    seqs = await harness.admin.ListSequences(pb.ListSequencesRequest(pool_id="n1", limit=2))
    assert [s.seq_id for s in seqs.sequences] == ["s0", "s1"] and seqs.truncated
    assert len((await harness.admin.ListSequences(pb.ListSequencesRequest())).sequences) == 3
    desc = await harness.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="s1"))
    assert (desc.block_size, desc.num_blocks, desc.table.num_tokens) == (4, 2, 5)
    await expect_code(
        harness.admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="nope")), grpc.StatusCode.NOT_FOUND
    )
    await expect_code(harness.admin.ListSequences(pb.ListSequencesRequest(pool_id="zz")), grpc.StatusCode.NOT_FOUND)
    nodes = (await harness.admin.ListNodes(pb.ListNodesRequest())).nodes
    assert [(n.node_id, n.epoch, n.geometry.head_dim) for n in nodes] == [("n1", 1, 8), ("n2", 1, 8)]
    fsck = await harness.admin.Fsck(pb.FsckRequest())
    assert fsck.ok and not fsck.problems


async def test_reset_prefix_cache(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.allocate("a", tokens=list(range(8)))
    await harness.free("a")
    before = (await harness.admin.Status(pb.StatusRequest())).pools[0]
    assert before.num_cached_blocks == 2
    r = await harness.admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id=rid()))
    assert r.num_blocks_reset == 2
    after = (await harness.admin.Status(pb.StatusRequest())).pools[0]
    assert (after.num_cached_blocks, after.num_free_blocks) == (0, 16)
    again = await harness.allocate("b", tokens=list(range(8)))
    assert list(again.alloc_num_cached_tokens) == [0]


async def test_admin_token_required_when_configured(start_server: Any) -> None:
    h: Harness = await start_server(admin_token="s3cret")
    await expect_code(h.admin.Status(pb.StatusRequest()), grpc.StatusCode.UNAUTHENTICATED)
    await expect_code(
        h.admin.Status(pb.StatusRequest(), metadata=(("authorization", "Bearer wrong"),)),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    ok = await h.admin.Status(pb.StatusRequest(), metadata=(("authorization", "Bearer s3cret"),))
    assert ok.state == "serving"
    # data plane, health and reflection stay open
    await h.register("n1")
    health = health_pb2_grpc.HealthStub(h.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING


async def test_health_and_reflection(harness: Harness) -> None:
    health = health_pb2_grpc.HealthStub(harness.channel)
    for service in ("", "pagedkv.v1.BlockManager", "pagedkv.v1.BlockManagerAdmin"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)

    async def requests() -> Any:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    services: set[str] = set()
    async for resp in stub.ServerReflectionInfo(requests()):
        services |= {s.name for s in resp.list_services_response.service}
    assert {"pagedkv.v1.BlockManager", "pagedkv.v1.BlockManagerAdmin", "grpc.health.v1.Health"} <= services
    assert harness.server.runtime is not None
    harness.server.runtime.begin_drain()

    async def not_serving() -> bool:
        resp = await health.Check(health_pb2.HealthCheckRequest())
        return resp.status == health_pb2.HealthCheckResponse.NOT_SERVING

    await eventually(not_serving)


async def test_metrics_endpoint(start_server: Any) -> None:
    h: Harness = await start_server(metrics_port=0)
    await h.register("n1", num_blocks=16)
    await h.allocate("a", tokens=list(range(8)))
    await h.allocate("b", tokens=list(range(8)))
    await h.fork("a", "c")
    await h.append(("c", 1))
    # a: 2 blocks; b: hits a's first block, recomputes the last (+1); c shares a's and
    # opens a fresh block for its 9th token (+1): 4 of 16 used.
    port = h.server.metrics.port
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    )
    assert 'pagedkv_kv_cache_usage_perc{pool="n1"} 0.25' in text
    assert 'pagedkv_blocks{pool="n1",state="used"} 4.0' in text
    assert 'pagedkv_prefix_cache_queries_total{pool="n1"} 16.0' in text
    assert 'pagedkv_prefix_cache_hits_total{pool="n1"} 4.0' in text
    assert 'pagedkv_cow_copies_total{pool="n1"} 0.0' in text  # c's first append opens a new block
    assert 'pagedkv_evictions_total{pool="n1"} 0.0' in text
    assert 'pagedkv_rpc_latency_seconds_count{code="OK",method="Step"} 4.0' in text
    assert "pagedkv_journal_transactions_total" in text
    assert 'pagedkv_fetched_blocks_total{pool="n1"} 0.0' in text and 'pagedkv_lent_blocks{pool="n1"} 0.0' in text

