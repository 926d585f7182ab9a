"""A model node without a model, for engine tests that are about scheduling, not numerics.

`FakeNode` registers a real pool with the engine's block manager client and answers `Generate`
like a node would, except that the sampled token is a pure function of what the engine sent
(the sequence's last token, its context length and the index of the token it samples, which a
real node's seeded draw depends on): a greedy request's tokens are then the
same however its steps were cut, preempted, recomputed or moved to another node, which is
exactly what a fault-free run and a faulty one must agree on. Faults are switches raising the
typed errors a real executor raises: `dead` (NodeUnreachable, as a SIGKILLed process),
`moved_on` (NodeMovedOn, a restart with a new epoch), `refuse` (NodeRefused), `delay_s` (a
slow node). A node may have a host tier (`host_num_blocks`: the engine swaps to it; the fake
moves no K/V, its tokens do not depend on it). `FlakyLocalClient` is the in-process block
manager with a "down" switch: its next `down_steps` Steps are not answered (UNAVAILABLE, the
request never reached it), as a block manager that restarts.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from engine.errors import NodeMovedOn, NodeRefused, NodeUnreachable
from engine.local_bm import LocalBlockManagerClient, LocalRpcError
from engine.node_api import NodeInfo, NodeStep, SampledToken
from pagedkv.v1 import block_manager_pb2 as pb

VOCAB = 512
EOS = 0


def fake_token(last_token: int, context_len: int, index: int) -> int:
    """The `index`-th output token after `last_token` at `context_len`. Never EOS (0):
    requests end by length."""
    return 1 + (last_token * 31 + context_len * 7 + index * 13) % (VOCAB - 1)


class FakeNode:
    def __init__(self, client: Any, node_id: str, num_blocks: int, *, block_size: int = 16,
                 max_model_len: int = 1 << 18, model: str = "fake", host_num_blocks: int = 0) -> None:
        self.node_id = node_id
        self.host_num_blocks = host_num_blocks
        self.client = client
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model = model
        self.dead = False
        self.moved_on = False          # refuse every step as moved on
        self.restart_next = False      # set by `restart`: the next step is refused (the epoch it was for ended)
        self.refuse = False
        self.delay_s = 0.0
        self.num_calls = 0
        self.num_failed = 0
        self.num_tokens = 0
        self._lock = threading.Lock()
        self.epoch = self.register()

    def register(self) -> int:
        reg = self.client.register_node(self.node_id, self.num_blocks, block_size=self.block_size, geometry={
            "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32", "device": "cpu"},
            host_num_blocks=self.host_num_blocks)
        self.epoch = reg.epoch
        return reg.epoch

    def restart(self) -> None:
        """Restart in place: register again now (a new epoch, as a restarted node does before it
        answers) and refuse the next step. Called between steps, never from a Generate: the
        in-process block manager is the engine's, which may be planning with it while a Generate runs."""
        self.register()
        self.restart_next = True

    def info(self, timeout_s: float | None = None) -> NodeInfo:
        if self.dead:
            raise NodeUnreachable(self.node_id, "connection refused", code="UNAVAILABLE")
        return NodeInfo(self.node_id, self.epoch, True, self.block_size, self.num_blocks, self.model, VOCAB,
                        self.max_model_len, (EOS,))

    def generate(self, step: NodeStep) -> list[SampledToken]:
        with self._lock:
            self.num_calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.restart_next and not self.dead:
            self.restart_next = False
            with self._lock:
                self.num_failed += 1
            raise NodeMovedOn(self.node_id, "restarted: unknown epoch", code="FAILED_PRECONDITION")
        for fault, error, code in ((self.dead, NodeUnreachable, "UNAVAILABLE"),
                                   (self.moved_on, NodeMovedOn, "FAILED_PRECONDITION"),
                                   (self.refuse, NodeRefused, "PERMISSION_DENIED")):
            if fault:
                with self._lock:
                    self.num_failed += 1
                raise error(self.node_id, "fake fault", code=code)
        tokens = [SampledToken(s.seq_id, fake_token(s.token_ids[-1], s.context_len, s.num_output_tokens))
                  for s in step.sequences if s.sampling is not None]
        with self._lock:
            self.num_tokens += sum(len(s.token_ids) for s in step.sequences)
        return tokens

    def close(self) -> None:
        pass


class FlakyLocalClient(LocalBlockManagerClient):
    """The in-process block manager, down for its next `down_steps` Steps (each refused
    UNAVAILABLE before it is applied: the engine resends it under its request id)."""

    down_steps = 0
    num_refused = 0

    def _step(self, request: pb.StepRequest) -> pb.StepResponse:
        if self.down_steps > 0:
            self.down_steps -= 1
            self.num_refused += 1
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "block manager down (fake)")
        return super()._step(request)


def fake_engine(num_nodes: int = 1, num_blocks: int = 4096, *, block_size: int = 16, watermark: float = 0.0,
                host_num_blocks: int = 0, **config: Any) -> tuple[Any, dict[str, FakeNode]]:
    """An engine over the in-process block manager (a `FlakyLocalClient`, up unless told
    otherwise) and `num_nodes` fake nodes."""
    from block_manager.service.config import BlockManagerConfig
    from engine.llm_engine import EngineConfig, LLMEngine

    client = FlakyLocalClient(BlockManagerConfig(database_url="memory://", block_size=block_size,
                                                 watermark=watermark))
    nodes = {f"fake-{i}": FakeNode(client, f"fake-{i}", num_blocks, block_size=block_size,
                                   host_num_blocks=host_num_blocks) for i in range(num_nodes)}
    engine = LLMEngine(client, dict(nodes), EngineConfig(**config))
    return engine, nodes


def fake_completion(prompt: list[int], num_tokens: int) -> list[int]:
    """The tokens a greedy request for `prompt` gets from fake nodes, however it was run."""
    out: list[int] = []
    last, context_len = prompt[-1], len(prompt)
    for index in range(num_tokens):
        last = fake_token(last, context_len, index)
        out.append(last)
        context_len += 1
    return out
