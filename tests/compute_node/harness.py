"""Test harness: a real block manager and real compute nodes on 127.0.0.1 ephemeral ports, plus a
test-side scheduler that keeps a shadow of every sequence's full K/V history.

The shadow is what makes the tests independent of the node's paging: expected outputs are the
float64 reference attention (`kernels.reference`) over the shadow history laid out as one dense
block, so copy-on-write, forks and defrag moves inside the node must not change a single output.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from block_manager.client import AsyncBlockManagerClient
from block_manager.client.async_client import AsyncStep
from block_manager.client.step import StepResult
from block_manager.client.types import PoolStepInfo
from block_manager.service.server import BlockManagerServer
from compute_node.client import SeqInput, build_request, split_outputs
from compute_node.service.config import load_config as load_cn_config
from compute_node.service.server import ComputeNodeServer
from kernels import reference
from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import block_manager_pb2_grpc as bm_grpc
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc
from tests.support.configs import bm_test_config

NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
BLOCK_SIZE = 4
NUM_BLOCKS = 64

_ids = itertools.count(1)


def rid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def prompt_kv(tokens: list[int], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """K/V `[num_layers, n, num_kv_heads, head_dim]` of a prompt, a deterministic function of
    each token's prefix — what a real model computes, so prefix-cache hits find the same K/V."""
    shape = (NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)
    keys, values = [], []
    for p in range(len(tokens)):
        rng = np.random.default_rng(zlib.crc32(np.asarray(tokens[: p + 1], dtype=np.int64).tobytes()))
        keys.append(rng.standard_normal(shape))
        values.append(rng.standard_normal(shape))
    return (np.stack(keys, axis=1).astype(dtype), np.stack(values, axis=1).astype(dtype))


def bm_config(**overrides: Any):  # type: ignore[no-untyped-def]
    return bm_test_config(**{"block_size": BLOCK_SIZE, **overrides})


def cn_config(bm_address: str, **overrides: Any):  # type: ignore[no-untyped-def]
    base: dict[str, Any] = {
        "node_id": "node-a",
        "listen_address": "127.0.0.1:0",
        "block_manager_address": bm_address,
        "geometry": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "num_blocks": NUM_BLOCKS,
        "device": "cpu",
        "rpc_timeout_s": 2.0,
        "retry_interval_s": 0.05,
        "shutdown_grace_s": 0.2,
    }
    base.update(overrides)
    return load_cn_config(**base)


async def start_bm(**overrides: Any) -> BlockManagerServer:
    server = BlockManagerServer(bm_config(**overrides))
    await server.start()
    return server


async def start_node(bm_address: str, **overrides: Any) -> ComputeNodeServer:
    server = ComputeNodeServer(cn_config(bm_address, **overrides))
    await server.start()
    assert server.node is not None
    await server.node.wait_registered(10.0)
    return server


@dataclass(slots=True)
class Shadow:
    """Everything the test knows about one sequence: its length and full K/V history."""

    seq_id: str
    num_tokens: int = 0
    # per layer: [num_tokens, num_kv_heads, head_dim] float64
    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)


@dataclass(slots=True)
class Step:
    """One sequence's part of a Forward: its new tokens' inputs (they go at its tail)."""

    seq_id: str
    query: np.ndarray   # [num_layers, n, num_heads, head_dim]
    key: np.ndarray     # [num_layers, n, num_kv_heads, head_dim]
    value: np.ndarray

    @property
    def num_new_tokens(self) -> int:
        return int(self.query.shape[1])


class Scheduler:
    """A scheduler over the real client library: one `Step` RPC per call that needs one (the
    client answers in-block decode appends itself), every `PoolStep` passed to the node in the
    next Forward, every Forward reported with the next step."""

    def __init__(
        self, bm_address: str, node_address: str, pool_id: str, *, seed: int = 0, dtype: str = "float32",
        tls: TlsSettings | None = None, token: str | None = None,
    ) -> None:
        """`tls` / `token`: the scheduler's credentials towards both services (none: plaintext)."""
        self.client = AsyncBlockManagerClient(
            bm_address, block_sizes={pool_id: BLOCK_SIZE}, timeout_s=30, scheduler_id=f"sched-{pool_id}", tls=tls,
            token=token,
        )
        self.bm = bm_grpc.BlockManagerStub(self.client._channel)
        self._tls, self._metadata = tls, token_metadata(token)
        self.node_channel = open_channel(node_address, tls, aio=True)
        self.node = pb_grpc.ComputeNodeStub(self.node_channel)
        self.pool_id = pool_id
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.seqs: dict[str, Shadow] = {}
        self.pending: list[PoolStepInfo] = []   # this pool's steps the node has not applied yet
        self.last_stats: pb.ForwardStats | None = None
        self.last_result: StepResult | None = None

    async def close(self) -> None:
        await self.client.close()
        await self.node_channel.close()

    def connect_node(self, node_address: str) -> None:
        """A channel to a (restarted) node; the old one must be closed first."""
        self.node_channel = open_channel(node_address, self._tls, aio=True)
        self.node = pb_grpc.ComputeNodeStub(self.node_channel)

    # ---- block manager side -------------------------------------------------------------
    async def commit(self, step: AsyncStep) -> StepResult:
        """Send a filled client step; keep its PoolStep for the next Forward."""
        res = await step.commit()
        if res.failures:
            raise RuntimeError(f"step items failed: {res.failures}")
        info = res.steps.get(self.pool_id)
        if info is not None:
            self.pending.append(info)
        self.last_result = res
        return res

    async def allocate(self, seq_id: str, tokens: list[int]) -> Step:
        step = self.client.step()
        step.allocate(seq_id, self.pool_id, tokens)
        res = await self.commit(step)
        cached = res.allocations[seq_id].num_cached_tokens   # type: ignore[union-attr]
        keys, values = prompt_kv(tokens, self.dtype)
        self.seqs[seq_id] = Shadow(
            seq_id, cached,
            [keys[layer, :cached].astype(np.float64) for layer in range(NUM_LAYERS)],
            [values[layer, :cached].astype(np.float64) for layer in range(NUM_LAYERS)],
        )
        n = len(tokens) - cached
        query = self.rng.standard_normal((NUM_LAYERS, n, NUM_HEADS, HEAD_DIM)).astype(self.dtype)
        return Step(seq_id, query, keys[:, cached:], values[:, cached:])

    async def append(self, seq_ids: list[str]) -> list[Step]:
        step = self.client.step()
        for s in seq_ids:
            step.append(s, num_new_tokens=1)
        await self.commit(step)
        return [self.new_step(s, 1) for s in seq_ids]

    async def fork(self, parent: str, children: list[str]) -> None:
        step = self.client.step()
        step.fork(parent, children)
        await self.commit(step)
        p = self.seqs[parent]
        for child in children:
            self.seqs[child] = Shadow(child, p.num_tokens, [k.copy() for k in p.keys], [v.copy() for v in p.values])

    async def free(self, seq_ids: list[str]) -> None:
        step = self.client.step()
        step.free(seq_ids)
        await self.commit(step)
        for s in seq_ids:
            del self.seqs[s]

    # ---- compute node side --------------------------------------------------------------
    def request(self, steps: list[Step], **kw: Any) -> pb.ForwardRequest:
        """The Forward of `steps`, carrying every pending PoolStep (not sent)."""
        seqs = [self.seq_input(s) for s in steps]
        return build_request(seqs, list(range(NUM_LAYERS)), steps=[p.message for p in self.pending], **kw)

    async def forward(self, steps: list[Step], *, atol: float = 2e-4, **kw: Any) -> list[np.ndarray]:
        """Forward the steps with the pending PoolSteps, report them done, commit the new
        tokens to the shadow and check every output against the float64 reference."""
        seqs = [self.seq_input(s) for s in steps]
        request = build_request(seqs, list(range(NUM_LAYERS)), steps=[p.message for p in self.pending], **kw)
        response = await self.node.Forward(request, metadata=self._metadata)
        self.delivered()
        self.last_stats = response.stats
        outputs = split_outputs(response, seqs)
        for step, out in zip(steps, outputs):
            self.commit_tokens(step)
            expected = self.expected(step)
            np.testing.assert_allclose(out, expected, atol=atol, rtol=1e-3, err_msg=f"sequence {step.seq_id}")
        return outputs

    def delivered(self, ok: bool = True) -> None:
        """The pending steps reached the node (`ok`) or never will: report them."""
        for info in self.pending:
            self.client.report(info, ok)
        self.pending.clear()

    def expected(self, step: Step) -> np.ndarray:
        """Reference attention of the step's queries over the (already committed) shadow."""
        shadow = self.seqs[step.seq_id]
        n, ctx = step.num_new_tokens, shadow.num_tokens
        result = np.empty((NUM_LAYERS, n, NUM_HEADS, HEAD_DIM))
        for layer in range(NUM_LAYERS):
            # The whole history as one dense block: table [[0]], block_size = ctx.
            kc = shadow.keys[layer].transpose(1, 0, 2)[None]
            vc = shadow.values[layer].transpose(1, 0, 2)[None]
            result[layer] = reference.paged_prefill_attention(
                step.query[layer].astype(np.float64), kc, vc, np.zeros((1, 1), np.int32),
                np.array([ctx], np.int32), np.array([0, n], np.int32), 1.0 / np.sqrt(HEAD_DIM),
            )
        return result

    def commit_tokens(self, step: Step) -> None:
        """The step's tokens are written: add them to the shadow history."""
        shadow = self.seqs[step.seq_id]
        for layer in range(NUM_LAYERS):
            shadow.keys[layer] = np.concatenate([shadow.keys[layer], step.key[layer].astype(np.float64)])
            shadow.values[layer] = np.concatenate([shadow.values[layer], step.value[layer].astype(np.float64)])
        shadow.num_tokens += step.num_new_tokens

    def seq_input(self, step: Step) -> SeqInput:
        shadow = self.seqs[step.seq_id]
        return SeqInput(step.seq_id, shadow.num_tokens + step.num_new_tokens, step.query, step.key, step.value)

    def new_step(self, seq_id: str, n: int) -> Step:
        """Random inputs for `n` new tokens of a sequence."""
        r = self.rng
        return Step(
            seq_id,
            r.standard_normal((NUM_LAYERS, n, NUM_HEADS, HEAD_DIM)).astype(self.dtype),
            r.standard_normal((NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM)).astype(self.dtype),
            r.standard_normal((NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM)).astype(self.dtype),
        )
