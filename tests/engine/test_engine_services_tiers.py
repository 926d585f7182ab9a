"""Swap preemption over real services: a block manager and two model nodes with host tiers
(in-process gRPC servers on 127.0.0.1 sockets, defragmentation after every step). Small
device pools force preemption; swapped-out sequences come back from their node's host tier,
and greedy tokens still equal transformers' with nothing recomputed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient
from engine.params import SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy
from tests.engine.services import Services
from tests.engine.test_engine_services import _prompts, _run_all

MODEL = "llama-gqa4-hd64"


@pytest.fixture(scope="module")
def services(model_dirs: dict[str, Path]) -> Iterator[Services]:
    s = Services(model_dirs[MODEL], node={"num_blocks": 20, "host_kv_blocks": 64})
    try:
        yield s
    finally:
        s.close()


def test_swap_preemption_over_services_matches_transformers(services: Services, hf_models: dict[str, Any]) -> None:
    engine = services.engine(max_num_batched_tokens=32, preemption_mode="swap")
    admin = AdminClient(services.bm.address)
    try:
        prompts = _prompts(9, [1, 4, 9, 3, 15, 6, 11, 2])
        params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
        outs = _run_all(engine, prompts, params)
        for i, (p, out) in enumerate(zip(prompts, outs)):
            ref = hf_greedy(hf_models[MODEL], p, params.max_tokens)
            for c in out.outputs:
                compare_greedy(c.token_ids, ref, f"prompt {i} completion {c.index}")
        stats = engine.stats.summary()
        assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
        # forks swapped out together share host blocks; swapped in one by one, each gets its own copy
        assert stats["recomputed_tokens"] == 0 and stats["swapped_in_blocks"] >= stats["swapped_out_blocks"] > 0
        pools = admin.status()["pools"]
        assert len(pools) == 2 and all(int(p.get("num_sequences", 0)) == 0 for p in pools)
        # both tiers in the admin status and in Prometheus, the block manager's counts = the engine's
        assert all(int(p["host_num_blocks"]) == 64 and int(p["num_swapped_sequences"]) == 0 for p in pools)
        assert sum(int(p["swapped_out_blocks"]) for p in pools) == stats["swapped_out_blocks"]
        assert sum(int(p["swapped_in_blocks"]) for p in pools) == stats["swapped_in_blocks"]
        text = services.bm.metrics.render().decode()
        assert 'pagedkv_host_blocks{pool="node-0",state="free"}' in text
        moved = [line for line in text.splitlines() if line.startswith("pagedkv_tier_moves_total{")
                 and 'kind="swap_out"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in moved) == stats["swapped_out_blocks"]
        assert admin.fsck().get("ok") is True
    finally:
        admin.close()
        engine.close()
        engine.client.close()
