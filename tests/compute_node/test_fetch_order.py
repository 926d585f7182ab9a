"""A prefix fetch lands in step order (docs/prefix_fetch.md, docs/tiers.md "Moves follow the
one-sequencer rule"): the block manager may give a fetch destination blocks that the same step
(or an earlier step of the same Forward) still swaps out or copies from, freed in that very step.
The node must write the fetched blocks only after those moves and copies have read them.

Real steps of the block manager core (`BlockManager`, converted to `PoolStep` messages as the
service does), a real source node serving `FetchBlocks` over gRPC on 127.0.0.1, and a real
destination `ComputeNode` applying them in a `Forward` (and the model node's `Generator`):
the swapped-out host copy and the copy-on-write copy hold the bytes the destination blocks held
before the step, and the destination blocks hold exactly the source's blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from block_manager.core.manager import BlockManager
from block_manager.core.types import StepOutput
from block_manager.service.step_answer import fill_pool_step, pool_step_dict
from compute_node.forward import parse_forward
from compute_node.generate import Generator
from compute_node.host_pool import HostKvPool
from compute_node.model import StepResult
from compute_node.pool import KvPool
from compute_node.service.bm_link import Registration
from compute_node.service.config import ComputeNodeConfig
from compute_node.service.node import ComputeNode
from compute_node.tables import TableCache
from pagedkv.v1 import common_pb2
from pagedkv.v1 import compute_node_pb2 as pb
from tests.compute_node.test_transfer import GEOM, _Source

NUM_BLOCKS = 8
BLOCK_SIZE = GEOM.block_size
DST_GEOM = dataclasses.replace(GEOM, num_blocks=NUM_BLOCKS)
PROMPT = list(range(1, 14))   # 3 full blocks fetched, the 13th token computed


@pytest.fixture
def source() -> Iterator[_Source]:
    s = _Source(fetch_grant_wait_s=2.0, fetch_chunk_bytes=4096)
    yield s
    s.stop()


class _Steps:
    """The block manager core with a source pool `s` (holding PROMPT, written) and the
    destination pool `d` (with a host tier); closed steps as the service sends them."""

    def __init__(self, source: _Source) -> None:
        self.source = source
        self.m = m = BlockManager(watermark=0.0)
        m.add_pool("s", 8, BLOCK_SIZE)
        m.add_pool("d", NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=8)
        m.allocate("src", "s", PROMPT)
        self.settle("s", self.close("s"))

    def close(self, pool: str) -> StepOutput:
        out = self.m.close_step(pool)
        assert out is not None
        return out

    def settle(self, pool: str, out: StepOutput) -> None:
        self.m.settle_steps(pool, out.step_id)

    def message(self, out: StepOutput) -> common_pb2.PoolStep:
        msg = common_pb2.PoolStep()
        fill_pool_step(msg, pool_step_dict(out, 1, lambda pool: self.source.address))
        return msg

    def grant_source(self) -> None:
        """The source applies its step: the grant of the fetch the destination's step carries."""
        self.source.node.grants.add(list(self.message(self.close("s")).serves))


def _destination() -> tuple[KvPool, HostKvPool]:
    """The destination's pools, every block random: the bytes "written" before the step."""
    pool = KvPool(DST_GEOM, torch.device("cpu"))
    host = HostKvPool(DST_GEOM, 8, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    for t in (*pool.key_caches, *pool.value_caches):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool, host


def _blocks(pool: Any, blocks: Any) -> list[torch.Tensor]:
    """Every layer's K and V of `blocks`, copied (the expected bytes, taken before the step)."""
    idx = list(blocks)
    return [t[idx].clone() for t in (*pool.key_caches, *pool.value_caches)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


async def _node(pool: KvPool, host: HostKvPool) -> ComputeNode:
    """A registered destination node (no block manager: every table arrives in its steps)."""
    node = ComputeNode(ComputeNodeConfig(node_id="d", block_manager_address="127.0.0.1:1"))
    node.pool, node.host_pool = pool, host
    node.registration = Registration(epoch=1, lease_ttl_s=60.0, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                     prefetch_window=0)
    return node


async def _forward(node: ComputeNode, request_id: str, steps: list[common_pb2.PoolStep]) -> None:
    request = pb.ForwardRequest(request_id=request_id, steps=steps)
    await node.forward(parse_forward(request, DST_GEOM, 64))


def _swap_out_then_fetch(steps: _Steps, *, one_step: bool) -> tuple[list[StepOutput], list[StepOutput]]:
    """`x` (12 tokens, blocks 0-2) is swapped out; `z`'s prefix is fetched into the blocks the
    swap-out frees — in the same step (`one_step`) or the next one. Returns the steps before
    the swap-out (x's allocation) and the ones to apply together."""
    m = steps.m
    m.allocate("x", "d", num_tokens=12)
    first = steps.close("d")
    steps.settle("d", first)
    m.swap_out(["x"])
    todo = []
    if not one_step:
        todo.append(steps.close("d"))
    m.allocate("z", "d", PROMPT, fetch_sources=["s"])
    todo.append(steps.close("d"))
    return [first], todo


def _check_swap_out_and_fetch(source: _Source, todo: list[StepOutput], pool: KvPool, host: HostKvPool,
                              before: KvPool) -> None:
    out_ops = [op for out in todo for op in out.tier_ops if op.to_host]
    (fetch,) = [f for out in todo for f in out.fetches]
    swapped = [op.src for op in out_ops]
    assert set(swapped) & set(fetch.dst_blocks), "the core no longer reuses the swapped-out blocks: rework the test"
    # x's host copy holds x's K/V, not the fetched prefix; the fetched blocks the source's
    assert _equal(_blocks(host, [op.dst for op in out_ops]), _blocks(before, swapped))
    assert _equal(_blocks(pool, fetch.dst_blocks), _blocks(source.node.pool, fetch.src_blocks))


@pytest.mark.parametrize("one_step", [True, False], ids=["same_step", "next_step_same_forward"])
async def test_a_fetch_into_blocks_the_forward_swaps_out_lands_after_the_swap_out(
        source: _Source, one_step: bool) -> None:
    steps = _Steps(source)
    pool, host = _destination()
    node = await _node(pool, host)
    try:
        done, todo = _swap_out_then_fetch(steps, one_step=one_step)
        await _forward(node, "r1", [steps.message(out) for out in done])
        before = KvPool(DST_GEOM, torch.device("cpu"))
        for src, dst in zip((*pool.key_caches, *pool.value_caches), (*before.key_caches, *before.value_caches)):
            dst.copy_(src)
        steps.grant_source()
        await _forward(node, "r2", [steps.message(out) for out in todo])
        _check_swap_out_and_fetch(source, todo, pool, host, before)
        assert node.tables.last_step_id == todo[-1].step_id
    finally:
        await node.stop()


async def test_a_fetch_into_the_source_of_the_steps_copy_lands_after_the_copy(source: _Source) -> None:
    """`x2` forks `x` and appends into their shared partial block (a copy-on-write copy out
    of it), `x` is freed in the same step, and `z`'s fetch lands in the freed block."""
    steps = _Steps(source)
    m = steps.m
    pool, host = _destination()
    node = await _node(pool, host)
    try:
        m.allocate("x", "d", num_tokens=6)
        first = steps.close("d")
        steps.settle("d", first)
        await _forward(node, "r1", [steps.message(first)])
        m.fork("x", ["x2"])
        m.append_tokens(["x2"], [1])
        m.free(["x"])
        m.allocate("z", "d", PROMPT, fetch_sources=["s"])
        out = steps.close("d")
        (copy,) = out.copy_ops
        (fetch,) = out.fetches
        assert copy.src in fetch.dst_blocks, "the core no longer reuses the copy's source: rework the test"
        expected_copy = _blocks(pool, [copy.src])
        steps.grant_source()
        await _forward(node, "r2", [steps.message(out)])
        assert _equal(_blocks(pool, [copy.dst]), expected_copy)
        assert _equal(_blocks(pool, fetch.dst_blocks), _blocks(source.node.pool, fetch.src_blocks))
    finally:
        await node.stop()


async def test_a_forward_whose_pull_fails_changes_nothing(source: _Source) -> None:
    """No grant at the source: the Forward fails (ABORTED) before its swap-out or any block is
    written, and a retry of the same steps (grant there now) applies them in order."""
    from compute_node.errors import PeerFetchFailed

    steps = _Steps(source)
    pool, host = _destination()
    node = await _node(pool, host)
    node.puller.timeout_s = 1.0
    try:
        done, todo = _swap_out_then_fetch(steps, one_step=False)
        await _forward(node, "r1", [steps.message(out) for out in done])
        before = KvPool(DST_GEOM, torch.device("cpu"))
        for src, dst in zip((*pool.key_caches, *pool.value_caches), (*before.key_caches, *before.value_caches)):
            dst.copy_(src)
        host_before = _blocks(host, range(8))
        messages = [steps.message(out) for out in todo]
        with pytest.raises(PeerFetchFailed):
            await _forward(node, "r2", messages)
        assert _equal(_blocks(pool, range(NUM_BLOCKS)), _blocks(before, range(NUM_BLOCKS)))
        assert _equal(_blocks(host, range(8)), host_before)
        assert node.tables.last_step_id == done[-1].step_id
        steps.grant_source()
        await _forward(node, "r3", messages)
        _check_swap_out_and_fetch(source, todo, pool, host, before)
    finally:
        await node.stop()


class _Runner:
    """What `Generator.generate` touches of a model runner for a step without sequences."""

    def __init__(self, pool: KvPool, host: HostKvPool) -> None:
        self.pool, self.host_pool, self.disk_store = pool, host, None
        self.geometry = DST_GEOM
        self.profile = False
        self.max_model_len = 64
        self.model_config = type("Config", (), {"vocab_size": 100})()

    def copy_blocks(self, pairs: Any) -> None:
        self.pool.copy_blocks(pairs)

    def run_step(self, work: Any) -> StepResult:
        return StepResult([])


@pytest.mark.parametrize("one_step", [True, False], ids=["same_step", "next_step_same_request"])
def test_a_generate_fetch_for_no_sequence_of_the_step_lands_after_the_swap_out(
        source: _Source, one_step: bool) -> None:
    """The Generate path: a fetch whose sequence the request does not compute (pulled before
    anything is applied, so a failure fails the step whole) lands in step order too."""
    from compute_node.transfer import BlockPuller

    steps = _Steps(source)
    pool, host = _destination()
    gen = Generator(_Runner(pool, host), TableCache())   # type: ignore[arg-type]  # the parts a step without sequences uses
    gen.puller = BlockPuller("d", tls=None, token=None, timeout_s=30)
    try:
        done, todo = _swap_out_then_fetch(steps, one_step=one_step)
        gen.generate(pb.GenerateRequest(request_id="g1", steps=[steps.message(out) for out in done]), "d", 1)
        before = KvPool(DST_GEOM, torch.device("cpu"))
        for src, dst in zip((*pool.key_caches, *pool.value_caches), (*before.key_caches, *before.value_caches)):
            dst.copy_(src)
        steps.grant_source()
        resp = gen.generate(pb.GenerateRequest(request_id="g2", steps=[steps.message(out) for out in todo]), "d", 1)
        _check_swap_out_and_fetch(source, todo, pool, host, before)
        assert resp.stats.fetched_blocks == 3 and resp.stats.fetch_recomputed_tokens == 0
    finally:
        gen.puller.close()

