"""A block manager and model nodes as in-process gRPC servers on 127.0.0.1 sockets, each on
one event-loop thread, for the engine's tests over real services."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from block_manager.client import BlockManagerClient
from block_manager.service.server import BlockManagerServer
from compute_node.service.config import load_config
from compute_node.service.server import ComputeNodeServer
from engine.executor import RemoteNode
from engine.llm_engine import EngineConfig, LLMEngine
from tests.support.configs import bm_test_config

# defrag policy checked after every step, planning whenever a pool is fragmented
AGGRESSIVE_DEFRAG = {"enabled": True, "every_n_steps": 1, "check_every_steps": 1, "min_contiguity": 1.0}


class Services:
    """A block manager and `num_nodes` model nodes serving `model_dir`; `bm` / `node` are
    config overrides of each (auth tokens, say). `add_node` starts one more later."""

    def __init__(self, model_dir: Path, *, num_nodes: int = 2, bm: dict[str, Any] | None = None,
                 node: dict[str, Any] | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bm = self._run(self._start_bm(**(bm or {"defrag": AGGRESSIVE_DEFRAG})))
        self.nodes: list[ComputeNodeServer] = []
        for i in range(num_nodes):
            self.add_node(f"node-{i}", model_dir, **(node or {}))

    def add_node(self, node_id: str, model_dir: Path, **overrides: Any) -> ComputeNodeServer:
        server = self._run(self._start_node(node_id, model_dir, **overrides))
        self.nodes.append(server)
        return server

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def _start_bm(self, **overrides: Any) -> BlockManagerServer:
        server = BlockManagerServer(bm_test_config(block_size=4, **overrides))
        await server.start()
        return server

    async def _start_node(self, node_id: str, model_dir: Path, **overrides: Any) -> ComputeNodeServer:
        cfg = load_config(**{"node_id": node_id, "listen_address": "127.0.0.1:0",
                             "block_manager_address": self.bm.address, "model": str(model_dir), "num_blocks": 96,
                             "block_size": 4, "device": "cpu", "shutdown_grace_s": 0.2, **overrides})
        server = ComputeNodeServer(cfg)
        await server.start()
        await server.node.wait_registered(30)
        return server

    def engine(self, **config: Any) -> LLMEngine:
        client = BlockManagerClient(self.bm.address)
        nodes = {n.config.node_id: RemoteNode(n.config.node_id, n.address) for n in self.nodes}
        return LLMEngine(client, nodes, EngineConfig(**config))

    def close(self) -> None:
        for n in self.nodes:
            self._run(n.stop(0))
        self._run(self.bm.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
