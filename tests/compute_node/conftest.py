"""Fixtures: a real block manager and a compute node, in-process, on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from block_manager.service.server import BlockManagerServer
from compute_node.service.server import ComputeNodeServer
from tests.compute_node.harness import Scheduler, start_bm, start_node


@dataclass(slots=True)
class Cluster:
    bm: BlockManagerServer
    node: ComputeNodeServer
    sched: Scheduler


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    bm = await start_bm()
    node = await start_node(bm.address)
    c = Cluster(bm, node, sched=Scheduler(bm.address, node.address, "node-a"))
    try:
        yield c
    finally:
        # Tests may replace the node or the block manager (restarts): stop the current ones.
        await c.sched.close()
        await c.node.stop(0)
        await c.bm.stop(0)


@pytest.fixture(scope="session", autouse=True)
def warm_kernels() -> None:
    """Compile (or load from Numba's cache) every CPU kernel once, before any server starts:
    a cold compile holds the GIL for seconds, which would starve heartbeats mid-test."""
    import torch

    import kernels

    kc = torch.zeros((4, 2, 4, 32), dtype=torch.float32)
    vc = torch.zeros_like(kc)
    kernels.write_slots(torch.ones((2, 2, 32)), torch.ones((2, 2, 32)), kc, vc, torch.tensor([0, 5]), backend="cpu")
    kernels.copy_blocks([kc], [vc], torch.tensor([[0, 1]]), backend="cpu")
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    kernels.paged_attention_decode(torch.ones((1, 4, 32)), kc, vc, table, lens, 0.1, backend="cpu")
    starts = torch.tensor([0, 2], dtype=torch.int32)
    kernels.paged_prefill_attention(torch.ones((2, 4, 32)), kc, vc, table, lens, starts, 0.1, backend="cpu")

