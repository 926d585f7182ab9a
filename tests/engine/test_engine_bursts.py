"""No input the API accepts stops the engine (issue 21): a long queue of ordinary prompts, or a
few very long ones, used to make the admission Route carry more token ids than the block
manager's limit (131,072), and `step()` raised out of the engine."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from compute_node.model.tiny import build_tiny_model
from engine.llm import LLM
from engine.params import SamplingParams
from tests.engine.fakes import VOCAB, fake_engine, fake_token

GREEDY2 = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]


def _micro_model(root: Path) -> Path:
    """One layer, 64 wide: the prompts' count and length are the point, not the model."""
    return build_tiny_model(root / "micro", "llama", num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                            head_dim=32, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=200_000,
                            seed=3)


@pytest.mark.slow   # the admission bound is crossed by default with fake nodes (the two tests below)
def test_a_burst_of_256_prompts_of_600_tokens_completes(tmp_path: Path) -> None:
    """256 x 600 = 153,600 queued prompt tokens, the real model in process, `LLM.generate`."""
    prompts = _prompts(1, 256, 600)
    with LLM(_micro_model(tmp_path), num_kv_blocks=256 * 600 // 16 + 512, device="cpu", max_model_len=1024) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY2)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 256
        assert all(o.finished for o in outs)
        core = llm.client.state.core   # type: ignore[attr-defined]
        assert core.fsck() == [] and core.sequences() == []


def test_three_prompts_of_50k_tokens_complete() -> None:
    """Three 50k-token prompts under a 200k context, through the engine over the in-process
    block manager (fake nodes: the model's arithmetic on 150k tokens is not what is checked
    here, the admission path is; tokens are checked against the fake's pure function)."""
    engine, _ = fake_engine(1, num_blocks=200_000 // 16 + 64)
    prompts = _prompts(2, 3, 50_000)
    ids = [engine.add_request(p, GREEDY2) for p in prompts]
    done = {}
    started = time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - started < 120:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == set(ids)
    for rid, p in zip(ids, prompts):
        first = fake_token(p[-1], len(p), 0)
        assert done[rid].outputs[0].token_ids == [first, fake_token(first, len(p) + 1, 1)]
    engine.flush()
    assert engine.client.state.core.sequences() == []


def test_a_burst_of_1000_prompts_with_fake_nodes_never_raises() -> None:
    """The queue far beyond what one Route or one Step may carry, two nodes, tight budget."""
    engine, nodes = fake_engine(2, num_blocks=2048, max_num_batched_tokens=4096, max_num_seqs=256)
    prompts = _prompts(3, 1000, 700)
    ids = {engine.add_request(p, GREEDY2) for p in prompts}
    finished: set[str] = set()
    started = time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - started < 120:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == ids
    assert all(n.num_tokens > 0 for n in nodes.values())   # both nodes took work
