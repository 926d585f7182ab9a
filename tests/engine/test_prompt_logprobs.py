"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`, vLLM's shape) equal transformers'
log-softmax of the same tokens, embedded and over real services, through chunked prefill,
`n > 1` forks and a prompt whose prefix is cached (a scoring request bypasses the cache, so
every position is computed in its own prefill).

Tolerance: |ours - transformers| <= 1e-4 per log-probability (float32 weights on both sides;
the model tests hold hidden states and logits to the same 1e-4), ranks and the top-N token ids
exact except where two reference log-probabilities lie within that tolerance (a near-tie
may order either way)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.pipeline as engine_pipeline
from engine.errors import NodeRefused
from engine.llm import LLM
from engine.node_api import NodeStep, PromptLogprobsSpec, SeqStep
from engine.params import InvalidParams, Logprob, RequestOutput, SamplingParams
from tests.engine.fakes import fake_engine
from tests.engine.services import Services
from tests.engine.test_engine_services import _run_all

ATOL = 1e-4
NAMES = ["llama-gqa4-hd64", "qwen2-gqa1-hd64-tied", "qwen3-gqa8-hd128"]


def _prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _reference(hf: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position (row i predicts token i + 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_prompt_logprobs(scored: list[dict[int, Logprob] | None] | None, prompt: list[int], ref: torch.Tensor,
                          num_top: int, label: str) -> None:
    """vLLM's shape (None first, then {token: Logprob} with the prompt token and the top N) and
    transformers' values."""
    assert scored is not None and len(scored) == len(prompt), label
    assert scored[0] is None, label
    for pos in range(1, len(prompt)):
        entry, row, token = scored[pos], ref[pos - 1], prompt[pos]
        assert entry is not None and token in entry, f"{label}: position {pos}"
        ours = entry[token]
        assert abs(ours.logprob - float(row[token])) <= ATOL, f"{label}: position {pos}: {ours} vs {float(row[token])}"
        higher = int((row > row[token] + ATOL).sum())
        ties = int((abs(row - row[token]) <= ATOL).sum())
        assert ours.rank is not None and higher + 1 <= ours.rank <= higher + ties, f"{label}: rank at {pos}"
        top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if tid != token or lp.rank <= num_top),
                     key=lambda x: x[0])
        assert [r for r, _, _ in top][:num_top] == list(range(1, num_top + 1)), f"{label}: top ranks at {pos}"
        assert len(entry) in (num_top, num_top + 1), f"{label}: {len(entry)} entries at {pos}"
        for rank, tid, lp in top:
            assert abs(lp - float(row[tid])) <= ATOL, f"{label}: top token {tid} at {pos}"
            # the rank-th best reference value, up to near-ties
            assert abs(float(torch.topk(row, rank).values[-1]) - lp) <= ATOL, f"{label}: rank {rank} at {pos}"


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_equal_transformers_chunked(name: str, model_dirs: dict[str, Path],
                                                    hf_models: dict[str, Any]) -> None:
    prompts = _prompts(5, [1, 2, 7, 23])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=128, device="cpu", max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i, (p, out) in enumerate(zip(prompts, outs)):
            check_prompt_logprobs(out.prompt_logprobs, p, _reference(hf_models[name], p), 3, f"{name} prompt {i}")
            assert all(lp.decoded_token is not None for e in out.prompt_logprobs[1:] for lp in e.values())  # type: ignore[union-attr]


def test_a_cached_prefix_is_scored_all_the_same(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    """A prompt whose prefix another request cached: without prompt_logprobs it hits the cache;
    with them it computes every position (num_cached_tokens 0) and the scores are
    transformers'; with n=2 (fork) the prompt is scored once, the same."""
    name = "llama-gqa4-hd64"
    shared = _prompts(6, [17])[0]
    prompt = shared + [7, 9, 11]
    ref = _reference(hf_models[name], prompt)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=128, device="cpu", max_num_batched_tokens=8) as llm:
        llm.generate([{"prompt_token_ids": shared + [1]}], plain)
        hit = llm.generate([{"prompt_token_ids": prompt}], plain)[0]
        assert hit.num_cached_tokens >= 16 and hit.prompt_logprobs is None
        for n in (1, 2):
            scored = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
                n=n, temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
            assert scored.num_cached_tokens == 0
            check_prompt_logprobs(scored.prompt_logprobs, prompt, ref, 1, f"cached prefix, n={n}")
            assert [c.token_ids for c in scored.outputs] == [hit.outputs[0].token_ids] * n
        again = llm.generate([{"prompt_token_ids": prompt}], plain)[0]
        assert again.num_cached_tokens >= 16                # the cache is still there for the others


def test_zero_asks_for_the_prompt_tokens_only(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    name = "qwen3-gqa8-hd128"
    prompt = _prompts(8, [9])[0]
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=64, device="cpu") as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1,
                                                                            prompt_logprobs=0))[0]
    check_prompt_logprobs(out.prompt_logprobs, prompt, _reference(hf_models[name], prompt), 0, "prompt_logprobs=0")
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])   # type: ignore[arg-type,union-attr]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_and_overlapped_requests_are_scored_right(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool too small for every sequence at once: sequences are preempted in the middle of
    their prompt (part of it scored) and recompute it from position 0 on re-admission, with
    chunked prefill, and with steps planned while the node runs the previous one. Every
    request's prompt scores are still transformers' (stored by position: a recomputed chunk
    overwrites, never duplicates)."""
    asked: dict[str, list[int]] = {}
    real_spec = engine_pipeline.scoring_spec

    def spy(seq: Any, start: int, end: int) -> Any:
        spec = real_spec(seq, start, end)
        if spec is not None:
            asked.setdefault(seq.request.request_id, []).append(start)
        return spec

    monkeypatch.setattr(engine_pipeline, "scoring_spec", spy)
    name = "qwen3-gqa8-hd128"
    prompts = _prompts(4, [30, 29, 31, 28, 27, 30])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=28, device="cpu", watermark=0.0,
             max_num_batched_tokens=16, async_scheduling=async_scheduling) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.stats.num_preemptions > 0
    assert any(starts.count(0) > 1 for starts in asked.values()), f"no prompt was rescored from 0: {asked}"
    for i, (p, out) in enumerate(zip(prompts, outs)):
        check_prompt_logprobs(out.prompt_logprobs, p, _reference(hf_models[name], p), 2, f"preempted prompt {i}")


@pytest.fixture(scope="module")
def services(model_dirs: dict[str, Path]) -> Iterator[Services]:
    s = Services(model_dirs["llama-gqa4-hd64"])
    try:
        yield s
    finally:
        s.close()


def test_services_mode_scores_over_grpc(services: Services, hf_models: dict[str, Any]) -> None:
    """Two model nodes over gRPC (the proto path), a cached prefix, chunked prefill."""
    hf = hf_models["llama-gqa4-hd64"]
    shared = _prompts(9, [14])[0]
    prompts = [shared + tail for tail in _prompts(10, [1, 6, 11])]
    engine = services.engine(max_num_batched_tokens=12)
    try:
        plain = _run_all(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert plain[0].prompt_logprobs is None
        outs = _run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                        prompt_logprobs=2))
        for i, (p, out) in enumerate(zip(prompts, outs)):
            assert out.num_cached_tokens == 0
            check_prompt_logprobs(out.prompt_logprobs, p, _reference(hf, p), 2, f"services prompt {i}")
    finally:
        engine.close()


def test_out_of_range_is_refused() -> None:
    for bad in (-1, 21, 1.5, True, "3"):
        with pytest.raises(InvalidParams, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)   # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


def test_a_node_that_does_not_score_fails_the_request_not_the_engine() -> None:
    """A node that ignores the field (one older than prompt scoring): the request ends with an
    error saying so, the engine and the other requests go on."""
    engine, _ = fake_engine(block_size=4)
    try:
        scored = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=2, prompt_logprobs=1))
        plain = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=2))
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert done[scored].error is not None and "prompt log-probabilities" in done[scored].error
        assert done[scored].outputs[0].finish_reason == "error"
        assert done[plain].error is None and len(done[plain].outputs[0].token_ids) == 2
    finally:
        engine.close()


@pytest.mark.parametrize("spec, why", [
    (PromptLogprobsSpec(21, (1,)), "num_top"),
    (PromptLogprobsSpec(0, (1, 2, 3)), "targets"),       # more targets than new tokens
    (PromptLogprobsSpec(0, ()), "targets"),
    (PromptLogprobsSpec(0, (512,)), "vocabulary"),
])
def test_the_node_refuses_a_bad_scoring_request(model_dirs: dict[str, Path], spec: PromptLogprobsSpec,
                                                why: str) -> None:
    """Checked with the rest of the step (the in-process node runs the gRPC node's `Generator`):
    INVALID_ARGUMENT before anything is applied."""
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=16, device="cpu") as llm:
        node = llm.engine.nodes["local-0"]
        with pytest.raises(NodeRefused, match=why) as err:
            node.generate(NodeStep("bad-scoring", [], [SeqStep("s", [5, 6], 2, 0, None, spec)]))
        assert err.value.code == "INVALID_ARGUMENT"
