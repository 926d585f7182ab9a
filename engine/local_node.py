"""A model node inside the engine's process (`LLM(model=DIR)` with no services).

It is the node's own step logic (`compute_node.generate.Generator`: the same checks, the same
table handling, the same model runner) with the gRPC layer left out: it registers its pool with
the engine's block manager client and answers `Generate` requests by direct call.

The model is loaded and every step computed on one thread of the node's own (a `StepThread`,
as in the node service), whoever calls: `LLM.generate` runs steps on the caller's thread, the
OpenAI server on the engine's thread (`AsyncLLMEngine`), which is not the one that loaded the
model. torch's CPU matmuls are libgomp parallel regions, and libgomp keeps a thread team per
calling thread: with two teams on a 2-core host it counts more threads than cores, throttles
its spin-wait and pays a wake-up in each of a decode step's ~120 regions — measured 10-13 ms a
token (~25%) for steps on another thread than the load's (BENCHMARKS.md, "Servers under a
load generator"). The hand-over costs a future per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from block_manager.client import BlockManagerClient
from compute_node.disk_tier import DiskTierCorrupt, open_disk_tier
from compute_node.errors import ComputeNodeError
from compute_node.generate import Generator, node_info_fields
from compute_node.model import ModelRunner
from compute_node.service.step_thread import StepThread
from compute_node.tables import TableCache
from engine.errors import EngineError
from engine.executor import generate_request, node_error, node_info, sampled_tokens
from engine.node_api import NodeInfo, NodeStep, SampledToken
from pagedkv.v1 import compute_node_pb2 as pb


class LocalNode:
    def __init__(self, node_id: str, runner: ModelRunner, epoch: int, model_name: str,
                 client: BlockManagerClient | None = None, thread: StepThread | None = None) -> None:
        self.node_id = node_id
        self.thread = thread if thread is not None else StepThread(f"node-{node_id}")   # see the module docstring
        self.client = client   # re-registers through it after a corrupt disk slot
        self.runner = runner
        self.epoch = epoch
        self.model_name = model_name
        self.tables = TableCache()
        self.generator = Generator(runner, self.tables)

    @classmethod
    def start(
        cls,
        client: BlockManagerClient,
        node_id: str,
        model_dir: str | Path,
        *,
        block_size: int,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        dtype: str | None = None,
        device: str = "auto",
        max_model_len: int | None = None,
        host_num_blocks: int | None = None,
        host_memory_bytes: int | None = None,
        disk_kv_path: str | Path | None = None,
        disk_kv_bytes: int | None = None,
        prepack_linear: bool = True,
    ) -> LocalNode:
        """Load the model, size the KV pool (on the node's thread), register it with `client`'s
        block manager."""
        def load() -> ModelRunner:
            runner = ModelRunner(model_dir, block_size=block_size, num_blocks=num_blocks,
                                 kv_memory_bytes=kv_memory_bytes, dtype=dtype, device=device,
                                 max_model_len=max_model_len, prepack_linear=prepack_linear)
            g = runner.geometry
            num_host = runner.attach_host_tier(host_num_blocks, host_memory_bytes) if (
                host_num_blocks or host_memory_bytes) else 0
            if disk_kv_path is not None:   # the disk tier under the host tier (docs/tiers.md)
                if not num_host:
                    raise ComputeNodeError("disk_kv_path needs a host tier (host_kv_memory or host_kv_blocks)")
                try:
                    runner.disk_store = open_disk_tier(disk_kv_path, int(disk_kv_bytes or 0), g, model_dir)
                except (ValueError, OSError) as exc:   # in use by another node, too small, unwritable
                    raise EngineError(f"disk tier at {str(disk_kv_path)!r}: {exc}") from exc
            return runner

        thread = StepThread(f"node-{node_id}")
        try:
            runner = thread.call(load)
        except BaseException:
            thread.close()
            raise
        node = cls(node_id, runner, 0, Path(model_dir).name, client, thread)
        try:
            node.register(client)
        except BaseException:
            node.close()
            raise
        return node

    def register(self, client: BlockManagerClient) -> None:
        """Register the pool (a new epoch) through `client`, with the blocks the disk tier holds now."""
        runner, g = self.runner, self.runner.geometry
        store = runner.disk_store
        disk: dict[str, Any] = {} if store is None else {
            "disk_num_blocks": store.num_blocks, "disk_blocks": store.register_blocks()}
        reg = client.register_node(self.node_id, g.num_blocks, block_size=g.block_size, geometry={
            "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
            "dtype": g.dtype, "device": str(runner.device),
        }, host_num_blocks=0 if runner.host_pool is None else runner.host_pool.num_blocks, **disk)
        self.epoch = reg.epoch
        self.tables.clear()
        self.generator.reset()

    def info(self, timeout_s: float | None = None) -> NodeInfo:
        g = self.runner.geometry
        return node_info(pb.GetNodeInfoResponse(
            node_id=self.node_id, epoch=self.epoch, registered=True, num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, dtype=g.dtype, device=str(self.runner.device),
            block_size=g.block_size, num_blocks=g.num_blocks, last_step_id=self.tables.last_step_id,
            num_cached_tables=len(self.tables), **node_info_fields(self.runner, self.model_name),
        ))

    def generate(self, step: NodeStep) -> list[SampledToken]:
        """The node's step logic on the protocol message; its typed errors become the engine's
        by their status code, exactly as over gRPC."""
        try:
            reply = self.thread.call(self.generator.generate, generate_request(step), self.node_id, self.epoch)
        except DiskTierCorrupt as exc:
            if self.client is not None:
                self.register(self.client)   # the disk index must lose the bad slot: a new epoch seeds it anew
            raise node_error(self.node_id, exc.code, str(exc)) from exc
        except ComputeNodeError as exc:
            raise node_error(self.node_id, exc.code, str(exc)) from exc
        return sampled_tokens(reply)

    def close(self) -> None:
        if self.runner.disk_store is not None:
            self.runner.disk_store.close()
        self.thread.close()


__all__ = ["LocalNode"]
