"""The engine over real services: a block manager and two model nodes on 127.0.0.1 sockets
(in-process servers), defragmentation running after every step. Greedy tokens still equal
transformers'; seeded sampling draws the same tokens as in the embedded mode."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.params import RequestOutput, SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy
from tests.engine.services import Services

MODEL = "llama-gqa4-hd64"


@pytest.fixture(scope="module")
def services(model_dirs: dict[str, Path]) -> Iterator[Services]:
    s = Services(model_dirs[MODEL])
    try:
        yield s
    finally:
        s.close()


def _run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
             on_step: Callable[[], None] | None = None) -> list[RequestOutput]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step()
    engine.flush()
    return [done[i] for i in ids]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 512) for _ in range(13)]
    return [shared + [rng.randrange(1, 512) for _ in range(n)] for n in lengths]


def test_two_nodes_with_defrag_match_transformers(services: Services, hf_models: dict[str, Any]) -> None:
    engine = services.engine(max_num_batched_tokens=24)
    admin = AdminClient(services.bm.address)
    try:
        prompts = _prompts(7, [1, 4, 9, 3, 15, 6, 11, 2])
        params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
        outs = _run_all(engine, prompts, params)
        for i, (p, out) in enumerate(zip(prompts, outs)):
            ref = hf_greedy(hf_models[MODEL], p, params.max_tokens)
            for c in out.outputs:
                compare_greedy(c.token_ids, ref, f"prompt {i} completion {c.index}")
        pools = admin.status()["pools"]
        assert len(pools) == 2 and all(int(p.get("num_sequences", 0)) == 0 for p in pools)   # all freed
        plans = sum(int(p.get("compaction_plans", 0)) + int(p.get("contiguity_plans", 0)) for p in pools)
        assert plans > 0 and sum(int(p.get("defrag_moves", 0)) for p in pools) > 0        # defrag ran meanwhile
        assert sum(int(p.get("cow_copies", 0)) for p in pools) > 0                          # n=2 forked
        assert admin.fsck().get("ok") is True
    finally:
        admin.close()
        engine.close()
        engine.client.close()


def test_seeded_sampling_same_in_services_and_embedded(services: Services, model_dirs: dict[str, Path]) -> None:
    prompts = _prompts(8, [2, 8, 5])
    params = SamplingParams(n=2, temperature=0.8, top_k=40, max_tokens=12, seed=99, ignore_eos=True)
    engine = services.engine()
    try:
        remote = [[c.token_ids for c in o.outputs] for o in _run_all(engine, prompts, params)]
    finally:
        engine.close()
        engine.client.close()
    with LLM(model_dirs[MODEL], block_size=4, num_kv_blocks=128, device="cpu") as llm:
        local = [[c.token_ids for c in o.outputs] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       params)]
    assert remote == local
