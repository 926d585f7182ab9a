"""Prefix fetch between nodes through the services (docs/prefix_fetch.md): a block manager, the
engine, and two model nodes as OS processes on 127.0.0.1.

A prompt's prefix is computed on node A; A is drained; the same prefix on node B is served by a
fetch (B's metrics count the fetched blocks and no recomputed prefix token, A's the served
ones) and its greedy tokens equal transformers'. Then the same with A killed in the middle of
the transfer (its stream held after the first chunk by the test hook, so the kill lands
mid-transfer deterministically): B recomputes the prefix in the same step, the tokens still
equal transformers', fsck is clean and nothing stays pinned."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient, BlockManagerClient
from demo import localstack
from engine.executor import RemoteNode
from engine.llm_engine import EngineConfig, LLMEngine
from engine.params import SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy
from tests.engine.services import Services
from tests.support.polling import eventually_sync

MODEL = "llama-gqa4-hd64"
ROOT = Path(__file__).resolve().parents[2]
BS = 4
PREFIX_BLOCKS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeProcess:
    """`compute-node serve` as a child process of the test (this checkout's code)."""

    def __init__(self, node_id: str, bm_address: str, model: Path, tmp: Path, **env: str) -> None:
        self.node_id = node_id
        self.port_file = tmp / f"{node_id}.port"
        self.metrics_port = _free_port()
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDKV_CN_NODE_ID": node_id,
                   "PAGEDKV_CN_LISTEN_ADDRESS": "127.0.0.1:0", "PAGEDKV_CN_BLOCK_MANAGER_ADDRESS": bm_address,
                   "PAGEDKV_CN_MODEL": str(model), "PAGEDKV_CN_NUM_BLOCKS": "96", "PAGEDKV_CN_BLOCK_SIZE": str(BS),
                   "PAGEDKV_CN_DEVICE": "cpu", "PAGEDKV_CN_THREADS": "1", "PAGEDKV_CN_SHUTDOWN_GRACE_S": "0.2",
                   "PAGEDKV_CN_METRICS_PORT": str(self.metrics_port), **env}
        self.log = open(tmp / f"{node_id}.log", "w")   # noqa: SIM115 (closed in stop)
        self.proc = localstack.start_process(
            [sys.executable, "-c", "import sys; from compute_node.service.cli import main; sys.exit(main())",
             "serve", "--port-file", str(self.port_file)],
            env=environ, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        )
        port = eventually_sync(lambda: self._port(), timeout_s=120, what=f"{node_id} listening")
        self.address = f"127.0.0.1:{port}"
        self.remote = RemoteNode(node_id, self.address)
        eventually_sync(lambda: self.remote.info(timeout_s=10).registered, timeout_s=120,
                        what=f"{node_id} registered")

    def _port(self) -> int | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.node_id} exited with {self.proc.returncode}")
        text = self.port_file.read_text().strip() if self.port_file.exists() else ""
        return int(text) if text else None

    def counter(self, name: str) -> float:
        """A counter from the node's Prometheus endpoint (0 when never incremented)."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).read().decode()
        for line in body.splitlines():
            if line.startswith(f"{name}_total "):
                return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.remote.close()
        self.log.close()


@pytest.fixture
def stack(model_dirs: dict[str, Path], tmp_path: Path) -> Iterator[dict[str, Any]]:
    services = Services(model_dirs[MODEL], num_nodes=0)
    started: list[NodeProcess] = []
    parts: dict[str, Any] = {"services": services, "tmp": tmp_path, "model": model_dirs[MODEL], "nodes": started}
    try:
        yield parts
    finally:
        engine = parts.get("engine")
        if engine is not None:
            engine.close()
            engine.client.close()
        for n in started:
            n.stop()
        services.close()


def _start(stack: dict[str, Any], *, pause_a: bool,
           **env_a: str) -> tuple[NodeProcess, NodeProcess, LLMEngine, AdminClient]:
    bm = stack["services"].bm.address
    if pause_a:
        env_a["PAGEDKV_CN_FETCH_TEST_PAUSE_FILE"] = str(stack["tmp"] / "paused")
    a = NodeProcess("node-a", bm, stack["model"], stack["tmp"], **env_a)
    stack["nodes"].append(a)
    # small chunks when A pauses after its first one: the transfer is then surely half sent
    env_b = {"PAGEDKV_CN_FETCH_CHUNK_BYTES": "4096"} if pause_a else {}
    b = NodeProcess("node-b", bm, stack["model"], stack["tmp"], **env_b)
    stack["nodes"].append(b)
    engine = LLMEngine(BlockManagerClient(bm), {"node-a": a.remote, "node-b": b.remote},
                       EngineConfig(max_num_batched_tokens=256))
    stack["engine"] = engine
    return a, b, engine, AdminClient(bm)


def _generate(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    rid = engine.add_request(prompt, params)
    out: list[int] | None = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                out = o.outputs[0].token_ids
    engine.flush()
    assert out is not None
    return out


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(19)
    prefix = [rng.randrange(1, 512) for _ in range(PREFIX_BLOCKS * BS)]
    return prefix + [rng.randrange(1, 512) for _ in range(3)], prefix + [rng.randrange(1, 512) for _ in range(5)]


def _prefix_on_a_then_drain_a(engine: LLMEngine, admin: AdminClient, first: list[int],
                              params: SamplingParams, hf: Any) -> None:
    admin.drain_node("node-b")                       # the prefix is computed on A
    compare_greedy(_generate(engine, first, params), hf_greedy(hf, first, params.max_tokens), "first on A")
    admin.drain_node("node-b", undrain=True)
    admin.drain_node("node-a")                       # A busy / going away: B must take the next one


def test_a_prefix_computed_on_a_drained_node_is_fetched_not_recomputed(stack, hf_models) -> None:  # type: ignore[no-untyped-def]
    a, b, engine, admin = _start(stack, pause_a=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, second = _prompts()
    try:
        _prefix_on_a_then_drain_a(engine, admin, first, params, hf_models[MODEL])
        cached_before = engine.stats.cached_prompt_tokens
        out = _generate(engine, second, params)
        compare_greedy(out, hf_greedy(hf_models[MODEL], second, params.max_tokens), "second on B (fetched)")
        assert engine.stats.fetched_tokens == PREFIX_BLOCKS * BS
        assert engine.stats.cached_prompt_tokens - cached_before == PREFIX_BLOCKS * BS   # nothing of it recomputed
        assert b.counter("pagedkv_cn_fetched_blocks") == PREFIX_BLOCKS
        assert b.counter("pagedkv_cn_fetch_recomputed_tokens") == 0
        assert a.counter("pagedkv_cn_served_blocks") == PREFIX_BLOCKS
        assert admin.fsck().get("ok") is True
        core = stack["services"].bm.runtime.state.core
        assert core.fetch_counts("node-a") == (0, 0)            # the loan ended
        assert core.fetch_counts("node-b") == (PREFIX_BLOCKS, 0)   # the block manager's count (metrics)
        pools = {p["pool_id"]: p for p in admin.status()["pools"]}
        assert int(pools["node-a"].get("num_sequences", 0)) == 0 == int(pools["node-b"].get("num_sequences", 0))
        # committed on the report: the prefix is now local on B (a hit, no fetch)
        third = second[: PREFIX_BLOCKS * BS] + [7, 8, 9]
        compare_greedy(_generate(engine, third, params), hf_greedy(hf_models[MODEL], third, params.max_tokens),
                       "third on B (local)")
        assert engine.stats.fetched_tokens == PREFIX_BLOCKS * BS
    finally:
        admin.close()


def test_killing_the_source_mid_transfer_falls_back_to_recompute(stack, hf_models) -> None:  # type: ignore[no-untyped-def]
    a, b, engine, admin = _start(stack, pause_a=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, second = _prompts()
    paused = stack["tmp"] / "paused"
    try:
        _prefix_on_a_then_drain_a(engine, admin, first, params, hf_models[MODEL])
        result: list[Any] = []
        runner = threading.Thread(target=lambda: result.append(_generate(engine, second, params)), daemon=True)
        runner.start()
        eventually_sync(paused.exists, timeout_s=120, what="the source paused mid-transfer")
        a.proc.kill()                                 # the source dies with the stream half sent
        a.proc.wait(30)
        runner.join(300)
        assert not runner.is_alive() and result, "the request did not complete"
        compare_greedy(result[0], hf_greedy(hf_models[MODEL], second, params.max_tokens), "second on B (recomputed)")
        assert b.counter("pagedkv_cn_fetched_blocks") == 0
        assert b.counter("pagedkv_cn_fetch_recomputed_tokens") == PREFIX_BLOCKS * BS
        assert admin.fsck().get("ok") is True
        core = stack["services"].bm.runtime.state.core
        assert core.fetch_counts("node-a") == (0, 0)    # nothing of A stays pinned (it is not fenced yet)
    finally:
        admin.close()


def test_a_prefix_partly_offloaded_to_the_sources_host_tier_is_fetched_from_both_tiers(  # type: ignore[no-untyped-def]
        stack, hf_models) -> None:
    """Node A has a small device pool and a host tier: a long prompt evicts the tail of the
    cached prefix to A's host tier (the head stays on device); the prefix on B is then fetched
    from A's device blocks and host blocks together, nothing recomputed, tokens still equal."""
    a, b, engine, admin = _start(stack, pause_a=False, PAGEDKV_CN_NUM_BLOCKS="40",
                                 PAGEDKV_CN_HOST_KV_BLOCKS="64")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, second = _prompts()
    core = stack["services"].bm.runtime.state.core
    try:
        admin.drain_node("node-b")
        compare_greedy(_generate(engine, first, params), hf_greedy(hf_models[MODEL], first, params.max_tokens),
                       "first on A")
        filler = [random.Random(5).randrange(1, 512) for _ in range(30 * BS)]
        _generate(engine, filler, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))   # evicts to host
        on_device = next(e for e in core.route(second, fetch_sources=[]) if e.pool_id == "node-a").num_cached_tokens
        assert on_device < PREFIX_BLOCKS * BS, "the filler evicted nothing of the prefix"
        assert core.host_metrics("node-a").offloaded_blocks > 0
        admin.drain_node("node-b", undrain=True)
        admin.drain_node("node-a")
        out = _generate(engine, second, params)
        compare_greedy(out, hf_greedy(hf_models[MODEL], second, params.max_tokens), "second on B (device + host)")
        assert engine.stats.fetched_tokens == PREFIX_BLOCKS * BS
        assert b.counter("pagedkv_cn_fetched_blocks") == PREFIX_BLOCKS
        assert b.counter("pagedkv_cn_fetch_recomputed_tokens") == 0
        assert admin.fsck().get("ok") is True and core.fetch_counts("node-a") == (0, 0)
    finally:
        admin.close()
