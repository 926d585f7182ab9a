"""Server surface: health, reflection, metrics endpoint, the sync client, `compute-node serve`
in a subprocess with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from compute_node.client import ComputeNodeClient, SeqInput
from demo.localstack import ServiceProcess
from tests.compute_node.harness import Scheduler, start_bm, start_node
from tests.support.polling import eventually

REPO = Path(__file__).resolve().parents[2]


async def test_health_reflection_and_metrics() -> None:
    bm = await start_bm()
    node = await start_node(bm.address, metrics_port=0)
    s = Scheduler(bm.address, node.address, "node-a")
    try:
        health = health_pb2_grpc.HealthStub(s.node_channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="pagedkv.v1.ComputeNode"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        refl = reflection_pb2_grpc.ServerReflectionStub(s.node_channel)
        names: list[str] = []
        async for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
            names += [svc.name for svc in r.list_services_response.service]
        assert "pagedkv.v1.ComputeNode" in names and "grpc.health.v1.Health" in names

        await s.forward([await s.allocate("a", [1, 2, 3, 4, 5])])
        await s.forward(await s.append(["a"]))
        url = f"http://127.0.0.1:{node.metrics_port}/metrics"
        text = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
        for phase in ("table_fetch", "copy_ops", "write", "attention", "total"):
            assert f'pagedkv_cn_forward_seconds_count{{phase="{phase}"}} 2.0' in text
        assert 'pagedkv_cn_tokens_total{kind="prefill"} 5.0' in text
        assert 'pagedkv_cn_tokens_total{kind="decode"} 1.0' in text
        assert "pagedkv_cn_pool_blocks 64.0" in text and 'dtype="float32"' in text
        bytes_read = [ln for ln in text.splitlines() if ln.startswith("pagedkv_cn_kv_bytes_read_total")]
        assert float(bytes_read[0].split()[1]) == (5 + 6) * 2 * 2 * 32 * 4 * 2   # tokens·K+V·heads·dim·4B·layers
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_sync_client_numpy_in_numpy_out(cluster) -> None:  # type: ignore[no-untyped-def]
    s = cluster.sched
    step = await s.allocate("c", [3, 1, 4, 1, 5, 9])
    pool_steps = [p.message for p in s.pending]

    def call() -> np.ndarray:
        with ComputeNodeClient(cluster.node.address) as client:
            assert client.node_info().registered
            seq = SeqInput("c", 6, step.query, step.key, step.value)
            out = client.forward([seq], layers=[0, 1], steps=pool_steps)
            assert out.stats.num_block_manager_rpcs == 0 and out.stats.last_step_id == pool_steps[-1].step_id
            return out.outputs[0]

    out = await asyncio.to_thread(call)
    s.delivered()
    s.commit_tokens(step)
    np.testing.assert_allclose(out, s.expected(step), atol=2e-4, rtol=1e-3)
    assert out.dtype == np.float32 and out.shape == (2, 6, 4, 32)


@pytest.mark.timeout(120)
async def test_cli_serve_registers_and_stops_on_sigterm(tmp_path: Path) -> None:
    bm = await start_bm()
    env = dict(os.environ, PAGEDKV_CN_DEVICE="cpu", PAGEDKV_CN_GEOMETRY__HEAD_DIM="32", PAGEDKV_LOG_LEVEL="INFO")
    argv = [
        sys.executable, "-m", "compute_node.service.cli", "serve", "--listen", "127.0.0.1:0",
        "--block-manager", bm.address, "--node-id", "cli-node", "--num-blocks", "16",
    ]
    node = await asyncio.to_thread(ServiceProcess.start, argv, workdir=tmp_path, name="cn", env=env, cwd=REPO)
    try:
        async def serving() -> bool:
            async with grpc.aio.insecure_channel(node.address) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        await eventually(serving, timeout_s=60, interval_s=0.1, what="compute node SERVING")
        nodes = [n for n in bm.runtime.state.registry.nodes() if n.node_id == "cli-node"]
        assert nodes and nodes[0].num_blocks == 16 and nodes[0].block_size == 4
        rc = await asyncio.to_thread(node.stop, signal.SIGTERM, 30)
        log = node.log_path.read_text() if node.log_path else ""
        assert rc == 0, log[-2000:]
        assert '"event": "stopped"' in log                # structlog JSON lines
    finally:
        node.stop(signal.SIGKILL)
        await bm.stop(0)


def test_cli_rejects_bad_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "compute_node.service.cli", "serve", "--num-blocks", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "num_blocks" in proc.stderr


def test_cli_names_an_unsupported_model_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    proc = subprocess.run(
        [sys.executable, "-m", "compute_node.service.cli", "serve", "--model", str(tmp_path), "--listen",
         "127.0.0.1:0", "--block-manager", "127.0.0.1:9"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2          # a model problem is a usage error, found before listening
    assert "GPT2LMHeadModel is not supported" in proc.stderr and "LlamaForCausalLM" in proc.stderr
