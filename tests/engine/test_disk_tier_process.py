"""The disk tier across a real node *process* restart (docs/tiers.md): a block manager (gRPC
server on 127.0.0.1) and a model node started as its own process (`compute-node serve
--disk-kv-path --disk-kv-bytes`) with a tiny device pool and host tier. Prefixes computed before
the restart are pushed down to disk; the node process is stopped and started again with the same
model: it reports its slot file's blocks when it registers (new epoch), the prefixes are
onboarded from disk (disk->host->device, zero prefix tokens recomputed) and greedy tokens equal
the pre-restart run and transformers'. A slot file damaged under the running node fails the
onboarding step (the node registers anew without the damaged slots) and a truncated one is
discarded at start: never served, the prompts are recomputed, tokens still right. Every wait
is on a condition, never a sleep."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient, BlockManagerClient
from block_manager.service.server import BlockManagerServer
from compute_node.disk_tier import FILE_NAME, HEADER_BYTES
from demo import localstack
from engine.executor import RemoteNode
from engine.llm_engine import EngineConfig, LLMEngine
from engine.params import SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy
from tests.engine.test_engine_services import _run_all
from tests.engine.test_llm import _prompts
from tests.support.configs import bm_test_config
from tests.support.polling import eventually_sync

MODEL = "llama-gqa4-hd64"
NODE = "disk-node"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class BlockManagerThread:
    """A block manager server on its own event-loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: BlockManagerServer = self._run(self._start())
        self.address = self.server.address

    async def _start(self) -> BlockManagerServer:
        server = BlockManagerServer(bm_test_config(block_size=4))
        await server.start()
        return server

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def close(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class NodeProcess:
    """`compute-node serve` as a child process (this worktree's code: PYTHONPATH)."""

    def __init__(self, model_dir: Path, bm_address: str, disk: Path, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = workdir / "port"
        self.port_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
               "PAGEDKV_CN_BLOCK_SIZE": "4", "PAGEDKV_CN_DEVICE": "cpu", "PAGEDKV_CN_THREADS": "1",
               "PAGEDKV_CN_SHUTDOWN_GRACE_S": "0.2"}
        self.log = (workdir / "node.log").open("ab")
        self.proc = localstack.start_process(
            [sys.executable, "-c", "import sys; from compute_node.service.cli import main; sys.exit(main())",
             "serve", "--listen", "127.0.0.1:0", "--block-manager", bm_address, "--node-id", NODE,
             "--model", str(model_dir), "--num-blocks", "12", "--host-kv-blocks", "6",
             "--disk-kv-path", str(disk), "--disk-kv-bytes", str(8 << 20), "--port-file", str(self.port_file)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        eventually_sync(self._port, timeout_s=180, what="the node process listening")
        self.address = f"127.0.0.1:{self._port()}"

    def _port(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the node process exited with {self.proc.returncode}")
        text = self.port_file.read_text().strip() if self.port_file.exists() else ""
        return text or None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


@pytest.fixture()
def bm() -> Iterator[BlockManagerThread]:
    server = BlockManagerThread()
    try:
        yield server
    finally:
        server.close()


def _pool(admin: AdminClient) -> dict[str, Any] | None:
    return next((p for p in admin.status().get("pools", []) if p["pool_id"] == NODE), None)


def _epoch(admin: AdminClient) -> int:
    nodes = admin.list_nodes().get("nodes", [])
    return max((int(n.get("epoch", 0)) for n in nodes if n["node_id"] == NODE and not n.get("fenced")), default=0)


def _serve(bm: BlockManagerThread, node: NodeProcess, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """One prompt at a time through a fresh engine; the completions and the engine's stats."""
    engine = LLMEngine(BlockManagerClient(bm.address), {NODE: RemoteNode(NODE, node.address)},
                       EngineConfig(max_num_seqs=1))
    try:
        outs = [_run_all(engine, [p], PARAMS)[0].outputs[0].token_ids for p in prompts]
        return [list(o) for o in outs], engine.stats.summary()
    finally:
        engine.close()
        engine.client.close()


def _start(bm: BlockManagerThread, admin: AdminClient, model_dir: Path, disk: Path, work: Path,
           after_epoch: int) -> NodeProcess:
    node = NodeProcess(model_dir, bm.address, disk, work)
    eventually_sync(lambda: _epoch(admin) > after_epoch and _pool(admin) is not None, timeout_s=180,
                    what="the node process registered (a new epoch)")
    return node


def test_a_restarted_node_process_onboards_its_prefixes_from_disk(
    bm: BlockManagerThread, tmp_path: Path, model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    systems = _prompts(51, [16, 16, 16, 16])
    tails = _prompts(52, [3] * 4)
    prompts = [s + t for s, t in zip(systems, tails)]
    refs = [hf_greedy(hf_models[MODEL], p, PARAMS.max_tokens) for p in prompts]
    disk = tmp_path / "disk"
    admin = AdminClient(bm.address)
    node = _start(bm, admin, model_dirs[MODEL], disk, tmp_path / "n1", 0)
    try:
        before, _ = _serve(bm, node, prompts)
        _serve(bm, node, _prompts(53, [19] * 6))    # 24 other blocks push all 16 of these below the host tier
        pool = _pool(admin)
        assert int(pool.get("disk_offloaded_blocks", 0)) > 0 and int(pool.get("disk_num_blocks", 0)) > 0
    finally:
        node.stop()
    for i, (got, ref) in enumerate(zip(before, refs)):
        compare_greedy(got, ref, f"before restart, prompt {i}")

    epoch = _epoch(admin)
    node = _start(bm, admin, model_dirs[MODEL], disk, tmp_path / "n2", epoch)
    try:
        assert int(_pool(admin).get("disk_cached_blocks", 0)) >= 8   # seeded from the node's slot file
        after, stats = _serve(bm, node, prompts)
        assert after == before
        # every prompt's 16-token prefix came from disk: 4 full blocks each, none recomputed
        assert stats["disk_hit_tokens"] == 4 * 16 and stats["disk_onboarded_blocks"] == 16
        assert stats["prefix_hit_tokens"] == 0 and stats["host_hit_tokens"] == 0
        assert int(_pool(admin)["disk_hit_tokens"]) == 4 * 16
        text = bm.server.metrics.render().decode()
        assert f'pagedkv_disk_moves_total{{kind="disk_onboard",pool="{NODE}"}} 16.0' in text
        assert admin.fsck().get("ok") is True
    finally:
        node.stop()

    seg = disk / FILE_NAME
    epoch = _epoch(admin)
    node = _start(bm, admin, model_dirs[MODEL], disk, tmp_path / "n3", epoch)
    try:   # the file is damaged under the running node: the onboarding step fails, nothing is served
        epoch = _epoch(admin)
        assert int(_pool(admin).get("disk_cached_blocks", 0)) >= 8
        data = bytearray(seg.read_bytes())
        for i in range(HEADER_BYTES + 9000, len(data), 4096):
            data[i] ^= 0x5A
        seg.write_bytes(bytes(data))
        again, stats = _serve(bm, node, prompts)
        assert again == before                                  # recomputed, still right
        assert _epoch(admin) > epoch                            # the node registered anew...
        assert int(_pool(admin).get("disk_hit_tokens", 0)) == 0    # ...without the damaged slots: no disk hit
        assert b"checksum on read" in (tmp_path / "n3" / "node.log").read_bytes()
    finally:
        node.stop()

    os.truncate(seg, HEADER_BYTES + 100)    # cut short: every slot is gone
    epoch = _epoch(admin)
    node = _start(bm, admin, model_dirs[MODEL], disk, tmp_path / "n4", epoch)
    try:
        assert int(_pool(admin).get("disk_cached_blocks", 0)) == 0
        again, stats = _serve(bm, node, prompts)
        assert again == before and stats["disk_hit_tokens"] == 0   # recomputed, still right
        assert b"disk_tier_truncated" in (tmp_path / "n4" / "node.log").read_bytes()
    finally:
        node.stop()
        admin.close()
