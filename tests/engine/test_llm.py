"""The engine end to end in one process (`LLM(model=DIR)`): greedy tokens equal transformers'
`generate` token for token (only a reference near-tie may diverge, as the model tests define),
through everything the engine does to a batch: mixed prompt lengths crossing block boundaries,
prefix-cache hits, chunked prefill, recompute preemption, n > 1 by fork."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from compute_node.model.errors import ModelNotFound
from engine.llm import LLM
from engine.llm_engine import EngineError
from engine.params import InvalidParams, SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _assert_all_freed(llm: LLM) -> None:
    """Every admission (and fork child) was freed: no sequence, no block held in the block manager."""
    llm.engine.flush()
    core = llm.client.state.core   # type: ignore[attr-defined]
    assert core.sequences() == [] and core.metrics("local-0").num_used_blocks == 0


def _check_greedy(llm: LLM, hf: Any, prompts: list[list[int]], label: str, params: SamplingParams = GREEDY) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf, p, params.max_tokens)
        for c in out.outputs:
            compare_greedy(c.token_ids, ref, f"{label} prompt {i} completion {c.index}")


@pytest.mark.parametrize("name", ["llama-gqa4-hd64", "qwen2-gqa1-hd64-tied", "qwen3-gqa8-hd128"])
def test_mixed_batch_matches_transformers(name: str, model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=256, device="cpu") as llm:
        _check_greedy(llm, hf_models[name], _prompts(1, [1, 3, 4, 5, 9, 17, 30]), name)


def test_prefix_hits_chunked_prefill_and_forks(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    name = "llama-gqa4-hd64"
    shared = _prompts(2, [21])[0]
    prompts = [shared + tail for tail in _prompts(3, [2, 7, 13])]
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=256, device="cpu", max_num_batched_tokens=8) as llm:
        _check_greedy(llm, hf_models[name], prompts[:1], "first")            # fills the prefix cache
        _check_greedy(llm, hf_models[name], prompts, "chunked + prefix hits")
        assert llm.engine.stats.cached_prompt_tokens >= 2 * 20              # whole shared blocks reused
        params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
        before = llm.engine.stats.num_steps
        _check_greedy(llm, hf_models[name], prompts[1:2], "n=3", params)    # children identical to the reference
        assert llm.engine.stats.num_steps > before
        _assert_all_freed(llm)


@pytest.mark.parametrize("name", ["llama-gqa4-hd64", "qwen3-gqa8-hd128"])
def test_prompts_admitted_together_share_their_prefix_in_that_step(
    name: str, model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """Six prompts with one 24-token system prompt, none cached yet, all admitted in the
    first step: the first computes the prefix, the other five read its blocks in that same
    step (the block manager shares them and charges the token budget only for what is
    computed) — what vLLM does; the outputs still equal transformers'."""
    shared = _prompts(4, [24])[0]
    prompts = [shared + tail for tail in _prompts(5, [3, 6, 1, 9, 4, 7])]
    budget = 24 + sum(len(p) - 24 for p in prompts)   # all of them only if the prefix counts once
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=256, device="cpu", max_num_batched_tokens=budget) as llm:
        for p in prompts:
            llm.engine.add_request(p, GREEDY)
        llm.engine.step()
        assert not llm.engine.waiting and llm.engine.stats.cached_prompt_tokens == 5 * 24
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        _check_greedy(llm, hf_models[name], prompts, "admitted together")   # again, now all cached
        llm.engine.flush()
        _assert_all_freed(llm)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=256, device="cpu", max_num_batched_tokens=budget) as llm:
        _check_greedy(llm, hf_models[name], prompts, "shared in the first step")
        assert llm.engine.stats.cached_prompt_tokens == 5 * 24


def test_preemption_and_resume_give_the_same_tokens(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    name = "qwen3-gqa8-hd128"
    prompts = _prompts(4, [10, 14, 6, 11, 9, 13])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 28 blocks of 4 slots cannot hold six sequences growing to ~38 tokens at once
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=28, device="cpu", watermark=0.0) as llm:
        _check_greedy(llm, hf_models[name], prompts, "preempted", params)
        assert llm.engine.stats.num_preemptions > 0
        _assert_all_freed(llm)   # re-admissions of preempted sequences included


def test_seeded_sampling_is_reproducible(model_dirs: dict[str, Path]) -> None:
    prompts = [{"prompt_token_ids": p} for p in _prompts(5, [5, 12])]
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    runs = []
    for num_blocks in (256, 24):    # the second run preempts: same tokens anyway
        with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=num_blocks, device="cpu",
                 watermark=0.0) as llm:
            runs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
            _assert_all_freed(llm)   # forks and preemptions included
    assert runs[0] == runs[1]
    assert runs[0][0][0] != runs[0][0][1]      # the two completions draw independent streams


def test_text_prompts_and_stop_tokens(model_dirs: dict[str, Path]) -> None:
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=128, device="cpu") as llm:
        out = llm.generate("the cache pages", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.prompt_token_ids[0] == llm.tokenizer.encode("x")[0]      # BOS from the tokenizer
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
        stop = out.outputs[0].token_ids[3]
        again = llm.generate("the cache pages", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                               stop_token_ids=(stop,)))[0]
        first = out.outputs[0].token_ids.index(stop)
        assert again.outputs[0].token_ids == out.outputs[0].token_ids[: first + 1]
        assert again.outputs[0].finish_reason == "stop"
        assert llm.engine.running == [] and not llm.engine.requests


def test_chat_takes_a_conversation_or_a_list_and_returns_a_list(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Like vLLM's `LLM.chat`: one conversation or many in, always a list out, each the greedy
    continuation of that conversation's chat template; an empty directory is named by its
    missing config.json, as the command line names it."""
    with pytest.raises(ModelNotFound, match="no config.json"):
        LLM(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [{"role": "user", "content": "what is a block table?"}]
    second = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=128, device="cpu") as llm:
        one = llm.chat(first, params)
        both = llm.chat([first, second], params)
        assert isinstance(one, list) and len(one) == 1 and len(both) == 2
        for conversation, out in zip([first, second], both):
            text = llm.tokenizer.apply_chat_template(conversation)
            assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
            ref = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params)[0]
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert one[0].outputs[0].token_ids == both[0].outputs[0].token_ids
        for bad in ([], "hello", {"role": "user", "content": "x"}, [first, "x"]):
            with pytest.raises(InvalidParams):
                llm.chat(bad, params)  # type: ignore[arg-type]
        assert not llm.engine.requests


def test_bad_input_is_refused_and_frees_everything(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(EngineError, match="PAGEDKV_CN_PREPACK_LINEAR"):   # a node setting, not the engine's
        LLM(model_dirs["llama-gqa4-hd64"], block_manager="127.0.0.1:1", prepack_linear=False)
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=64, device="cpu", max_model_len=64) as llm:
        with pytest.raises(EngineError, match="context"):
            llm.generate({"prompt_token_ids": [1] * 64})
        with pytest.raises(InvalidParams, match="vocabulary|\\[0, 512\\)"):
            llm.generate({"prompt_token_ids": [1, 99999]})
        for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"n": 0}, {"seed": -1}):
            with pytest.raises(InvalidParams):
                SamplingParams(**bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidParams):
            llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": "x"}])
        assert not llm.engine.requests and not llm.engine.waiting    # nothing left behind
        assert llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize(("options", "said"), [
    ({"block_size": 0}, "block_size"),
    ({"device": "tpu:0"}, "device: expected auto, cpu, cuda or cuda:N, got 'tpu:0'"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"preemption_mode": "sometimes"}, "preemption_mode"),
    ({"watermark": 2.0}, "watermark"),
    ({"disk_kv_bytes": 1 << 20}, "give both disk_kv_path and disk_kv_bytes"),
])
def test_bad_arguments_are_said_before_the_tokenizer_or_the_weights_load(
        model_dirs: dict[str, Path], tmp_path: Path, options: dict[str, Any], said: str) -> None:
    """Every argument is checked with the config.json, before the slow part: a directory with a
    config and nothing else still gets the argument's error, not the tokenizer's."""
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(model_dirs["llama-gqa4-hd64"] / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match=re.escape(said)):
        LLM(bare, **options)


def test_stress_forks_preemption_prefix_hits_every_step_checked(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """Many requests with n = 1..3, shared prefixes, a pool far too small for them and small
    step budgets: the block manager's fsck is clean after every step, every greedy completion
    equals transformers', and nothing is left held at the end."""
    name = "llama-gqa4-hd64"
    rng = random.Random(9)
    shared = _prompts(10, [9])[0]
    prompts = [(shared if rng.random() < 0.5 else []) + _prompts(11 + i, [rng.randrange(2, 14)])[0]
               for i in range(18)]
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=40, device="cpu", watermark=0.0,
             max_num_batched_tokens=16, max_num_seqs=12) as llm:
        engine = llm.engine
        core = llm.client.state.core   # type: ignore[attr-defined]
        ids = []
        for i, p in enumerate(prompts):
            params = SamplingParams(n=1 + i % 3, temperature=0, max_tokens=6 + i % 9, ignore_eos=True)
            ids.append((engine.add_request(p, params), params))
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            assert core.fsck() == []
        assert engine.stats.num_preemptions > 0 and engine.stats.cached_prompt_tokens > 0
        assert core.metrics("local-0").cow_copies > 0          # n > 1 forked and copied on write
        for (rid, params), p in zip(ids, prompts):
            ref = hf_greedy(hf_models[name], p, params.max_tokens)
            for c in done[rid].outputs:
                compare_greedy(c.token_ids, ref, f"{rid} completion {c.index}")
        _assert_all_freed(llm)


@pytest.mark.parametrize("seed", [13, 14, 15])
def test_aborts_at_random_points_leave_nothing_held(model_dirs: dict[str, Path], seed: int) -> None:
    """Requests aborted at random steps (waiting, prefilling, forking, decoding, preempted) free
    everything they held; the others complete; fsck is clean after every step."""
    rng = random.Random(seed)
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=36, device="cpu", watermark=0.0,
             max_num_batched_tokens=12, max_num_seqs=10) as llm:
        engine = llm.engine
        core = llm.client.state.core   # type: ignore[attr-defined]
        ids = [engine.add_request(p, SamplingParams(n=1 + i % 3, temperature=0.7, seed=i, max_tokens=12,
                                                    ignore_eos=True))
               for i, p in enumerate(_prompts(seed, [rng.randrange(2, 20) for _ in range(16)]))]
        finished: set[str] = set()
        aborted: set[str] = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
            live = [r for r in ids if r in engine.requests]
            if live and rng.random() < 0.3:
                victim = rng.choice(live)
                engine.abort_request(victim)
                aborted.add(victim)
            assert core.fsck() == []
        assert aborted and finished - aborted and engine.stats.num_preemptions > 0
        _assert_all_freed(llm)


def test_nodes_profile_a_step_only_when_asked(model_dirs: dict[str, Path]) -> None:
    """Phase timings (device syncs on a GPU) are filled only for steps that ask for them."""
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=64, device="cpu") as llm:
        node = llm.engine.nodes["local-0"]
        generate, seen = node.generator.generate, []

        def recording(request: Any, *args: Any) -> Any:
            reply = generate(request, *args)
            seen.append((request.profile, reply.stats.dense_s, reply.stats.total_s))
            return reply

        node.generator.generate = recording
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
        llm.engine.config.profile_nodes = True
        llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=3))
        plain = [s for s in seen if not s[0]]
        profiled = [s for s in seen if s[0]]
        assert plain and profiled
        assert all(dense == 0.0 and total > 0 for _, dense, total in plain)
        assert all(dense > 0 for _, dense, _ in profiled)
