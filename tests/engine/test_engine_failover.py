"""The engine rides out a block-manager failover: a leader and a standby (real processes on a
throwaway PostgreSQL), one model node and `LLM(block_manager="leader,standby")`; the leader is
killed with SIGKILL while sequences decode. Every request completes with the tokens of a
fault-free run (transformers' greedy), none is lost or computed twice, fsck is clean."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient
from compute_node.service.config import load_config
from compute_node.service.server import ComputeNodeServer
from engine.llm import LLM
from tests.block_manager.service.failover_helpers import start_server, wait_serving
from tests.engine.test_engine_remote import MODEL, _check_drive, _drive, _prompts

pytestmark = pytest.mark.postgres


class _NodeThread:
    """One model node on its own event-loop thread, registered through an address list."""

    def __init__(self, model_dir: Path, bm_targets: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = load_config(node_id="node-0", listen_address="127.0.0.1:0", block_manager_address=bm_targets,
                          model=str(model_dir), num_blocks=96, block_size=4, device="cpu", shutdown_grace_s=0.2,
                          rpc_timeout_s=2.0)
        self.server = ComputeNodeServer(cfg)
        self._run(self.server.start())
        self._run(self.server.node.wait_registered(60))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def close(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_engine_rides_out_a_killed_leader(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], tmp_path: Path, fresh_postgres_url: str
) -> None:
    lease_s = 2.0
    leader = start_server(fresh_postgres_url, tmp_path, "leader", lease_s)
    standby = None
    node = None
    try:
        asyncio.run(wait_serving(leader.address))
        standby = start_server(fresh_postgres_url, tmp_path, "standby", lease_s)
        targets = f"{leader.address},{standby.address}"
        node = _NodeThread(model_dirs[MODEL], targets)
        with LLM(model_dirs[MODEL], block_manager=targets, max_num_batched_tokens=32) as llm:
            engine = llm.engine
            prompts = _prompts(7, 6)
            killed = threading.Event()

            def kill_once_decoding() -> None:
                if not killed.is_set() and any(s.num_output_tokens >= 3 for s in engine.running):
                    leader.stop(signal.SIGKILL)
                    killed.set()

            outs = _drive(engine, prompts, 16, kill_once_decoding)
            assert killed.is_set()
            assert engine.client.address == standby.address   # the engine moved to the new leader
            assert engine.client.stats.retries >= 1
        _check_drive(hf_models[MODEL], prompts, outs, 16)
        with AdminClient(targets) as admin:
            assert admin.status()["state"] == "serving"
            assert admin.fsck().get("ok") is True and not admin.list_sequences().get("sequences")
    finally:
        if node is not None:
            node.close()
        leader.stop(signal.SIGKILL)
        if standby is not None:
            standby.stop()
