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

import grpc
import numpy as np

from block_manager.service.server import BlockManagerServer
from compute_node.client import SeqInput, build_request, split_outputs
from compute_node.service.config import load_config as load_cn_config
from compute_node.service.server import ComputeNodeServer
from kernels import reference
from pagedkv.v1 import block_manager_pb2 as bm_pb
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
    """Everything the test knows about one sequence: BM bookkeeping + full K/V history."""

    seq_id: str
    version: int
    num_tokens: int = 0
    # per layer: [num_tokens, num_kv_heads, head_dim] float64
    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)


@dataclass(slots=True)
class Step:
    """One sequence's part of a forward: its new tokens' slots and inputs."""

    seq_id: str
    slot_mapping: list[int]
    query: np.ndarray   # [num_layers, n, num_heads, head_dim]
    key: np.ndarray     # [num_layers, n, num_kv_heads, head_dim]
    value: np.ndarray


class Scheduler:
    """Drives the block manager (Allocate/AppendSlots/Fork/Free) and the node (Forward)."""

    def __init__(
        self, bm_address: str, node_address: str, pool_id: str, *, seed: int = 0, dtype: str = "float32"
    ) -> None:
        self.bm_channel = grpc.aio.insecure_channel(bm_address)
        self.bm = bm_grpc.BlockManagerStub(self.bm_channel)
        self.node_channel = grpc.aio.insecure_channel(node_address)
        self.node = pb_grpc.ComputeNodeStub(self.node_channel)
        self.pool_id = pool_id
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.seqs: dict[str, Shadow] = {}
        self.last_stats: pb.ForwardStats | None = None

    async def close(self) -> None:
        await self.bm_channel.close()
        await self.node_channel.close()

    def connect_bm(self, bm_address: str) -> None:
        """A new channel to a (restarted) block manager; the old one must be closed first."""
        self.bm_channel = grpc.aio.insecure_channel(bm_address)
        self.bm = bm_grpc.BlockManagerStub(self.bm_channel)

    # ---- block manager side -------------------------------------------------------------
    async def allocate(self, seq_id: str, tokens: list[int]) -> Step:
        resp = await self.bm.Allocate(
            bm_pb.AllocateRequest(
                request_id=rid("alloc"),
                items=[bm_pb.AllocateItem(seq_id=seq_id, pool_id=self.pool_id, token_ids=tokens)],
            ),
            wait_for_ready=True, timeout=30,
        )
        out = resp.outcomes[0]
        if out.HasField("error"):
            raise RuntimeError(f"allocate {seq_id}: {out.error}")
        a = out.allocation
        cached = int(a.num_cached_tokens)
        keys, values = prompt_kv(tokens, self.dtype)
        self.seqs[seq_id] = Shadow(
            seq_id, int(a.version), cached,
            [keys[layer, :cached].astype(np.float64) for layer in range(NUM_LAYERS)],
            [values[layer, :cached].astype(np.float64) for layer in range(NUM_LAYERS)],
        )
        slots = list(a.slot_mapping)
        n = len(slots)
        query = self.rng.standard_normal((NUM_LAYERS, n, NUM_HEADS, HEAD_DIM)).astype(self.dtype)
        return Step(seq_id, slots, query, keys[:, cached:], values[:, cached:])

    async def append(self, seq_ids: list[str]) -> list[Step]:
        resp = await self.bm.AppendSlots(
            bm_pb.AppendSlotsRequest(
                request_id=rid("app"), items=[bm_pb.AppendItem(seq_id=s, num_new_tokens=1) for s in seq_ids]
            ),
            wait_for_ready=True, timeout=30,
        )
        steps = []
        for seq_id, out in zip(seq_ids, resp.outcomes):
            if out.HasField("error"):
                raise RuntimeError(f"append {seq_id}: {out.error}")
            self.seqs[seq_id].version = int(out.appended.version)
            steps.append(self._new_step(seq_id, list(out.appended.slot_mapping)))
        return steps

    async def fork(self, parent: str, children: list[str]) -> None:
        resp = await self.bm.Fork(
            bm_pb.ForkRequest(request_id=rid("fork"), parent_seq_id=parent, child_seq_ids=children)
        )
        p = self.seqs[parent]
        for child in resp.children:
            self.seqs[child.seq_id] = Shadow(
                child.seq_id, int(child.version), p.num_tokens,
                [k.copy() for k in p.keys], [v.copy() for v in p.values],
            )

    async def free(self, seq_ids: list[str]) -> None:
        await self.bm.Free(bm_pb.FreeRequest(request_id=rid("free"), seq_ids=seq_ids))
        for s in seq_ids:
            del self.seqs[s]

    # ---- compute node side --------------------------------------------------------------
    def request(self, steps: list[Step], **kw: Any) -> pb.ForwardRequest:
        seqs = [self._seq_input(s) for s in steps]
        return build_request(seqs, list(range(NUM_LAYERS)), **kw)

    async def forward(self, steps: list[Step], *, atol: float = 2e-4, **kw: Any) -> list[np.ndarray]:
        """Forward the steps, commit them to the shadow and check every output against the
        float64 reference over the shadow history."""
        seqs = [self._seq_input(s) for s in steps]
        response = await self.node.Forward(build_request(seqs, list(range(NUM_LAYERS)), **kw))
        self.last_stats = response.stats
        outputs = split_outputs(response, seqs)
        for step, out in zip(steps, outputs):
            self._commit(step)
            expected = self.expected(step)
            np.testing.assert_allclose(out, expected, atol=atol, rtol=1e-3, err_msg=f"sequence {step.seq_id}")
        return outputs

    def expected(self, step: Step) -> np.ndarray:
        """Reference attention of the step's queries over the (already committed) shadow."""
        shadow = self.seqs[step.seq_id]
        n, ctx = len(step.slot_mapping), shadow.num_tokens
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

    def _commit(self, step: Step) -> None:
        shadow = self.seqs[step.seq_id]
        for layer in range(NUM_LAYERS):
            shadow.keys[layer] = np.concatenate([shadow.keys[layer], step.key[layer].astype(np.float64)])
            shadow.values[layer] = np.concatenate([shadow.values[layer], step.value[layer].astype(np.float64)])
        shadow.num_tokens += len(step.slot_mapping)

    def _seq_input(self, step: Step) -> SeqInput:
        shadow = self.seqs[step.seq_id]
        return SeqInput(
            step.seq_id, shadow.version, shadow.num_tokens + len(step.slot_mapping), step.slot_mapping,
            step.query, step.key, step.value,
        )

    def _new_step(self, seq_id: str, slots: list[int]) -> Step:
        n = len(slots)
        r = self.rng
        return Step(
            seq_id,
            slots,
            r.standard_normal((NUM_LAYERS, n, NUM_HEADS, HEAD_DIM)).astype(self.dtype),
            r.standard_normal((NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM)).astype(self.dtype),
            r.standard_normal((NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM)).astype(self.dtype),
        )

