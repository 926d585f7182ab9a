"""Swap preemption and host-tier prefix onboarding through the embedded `LLM` (docs/tiers.md):
greedy tokens equal transformers' token for token while sequences are swapped to the node's
host tier and back (possibly into other device blocks), n > 1 forks included, and while evicted
prefix blocks are offloaded and onboarded instead of recomputed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine.llm_engine import EngineConfig
from engine.params import SamplingParams
from tests.engine.test_llm import _assert_all_freed, _check_greedy, _prompts


def _host(llm: LLM) -> Any:
    return llm.client.state.core.host_metrics("local-0")   # type: ignore[attr-defined]


# qwen3 (head_dim 128) behind --slow (~5 CPU-s): by default its pool still swaps a sequence out
# and back, tokens checked, in test_a_full_host_tier_falls_back_to_recompute (same scenario)
@pytest.mark.parametrize("name", [pytest.param("qwen3-gqa8-hd128", marks=pytest.mark.slow), "llama-gqa4-hd64"])
def test_swap_preemption_gives_the_same_tokens(name: str, model_dirs: dict[str, Path],
                                               hf_models: dict[str, Any]) -> None:
    prompts = _prompts(4, [10, 14, 6, 11, 9, 13])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 28 blocks of 4 slots cannot hold six sequences growing to ~38 tokens at once: preempted
    # sequences go to the 64-block host tier and come back, nothing recomputed
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=28, device="cpu", watermark=0.0,
             host_kv_blocks=64, preemption_mode="swap") as llm:
        _check_greedy(llm, hf_models[name], prompts, "swapped", params)
        stats = llm.stats()
        assert stats["preemptions"] > 0 and stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
        assert stats["recomputed_tokens"] == 0 and stats["recompute_fallbacks"] == 0
        assert stats["swapped_out_blocks"] > 0 and stats["swapped_in_blocks"] == stats["swapped_out_blocks"]
        host = _host(llm)
        assert host.swapped_out_blocks == stats["swapped_out_blocks"] and host.num_swapped_sequences == 0
        _assert_all_freed(llm)
        assert llm.client.state.core.fsck() == []   # type: ignore[attr-defined]


def test_swapped_forks_give_the_same_tokens(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    name = "qwen2-gqa1-hd64-tied"
    prompts = _prompts(7, [9, 13, 7])
    params = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=30, device="cpu", watermark=0.0,
             host_kv_blocks=96) as llm:   # "auto": the node has a host tier, so swap
        assert llm.engine.config.preemption_mode == "auto"
        _check_greedy(llm, hf_models[name], prompts, "swapped forks", params)
        stats = llm.stats()
        assert stats["swap_outs"] > 0 and stats["recomputed_tokens"] == 0
        _assert_all_freed(llm)


def test_a_full_host_tier_falls_back_to_recompute(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    name = "qwen3-gqa8-hd128"
    prompts = _prompts(4, [10, 14, 6, 11, 9, 13])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=28, device="cpu", watermark=0.0,
             host_kv_blocks=3, preemption_mode="swap") as llm:
        _check_greedy(llm, hf_models[name], prompts, "fallback", params)
        stats = llm.stats()
        assert stats["recompute_fallbacks"] > 0 and stats["recomputed_tokens"] > 0
        assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]   # what fits still swaps
        _assert_all_freed(llm)


def test_onboarded_prefixes_give_the_same_tokens(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    """Four 16-token system prompts, a device pool that caches about one: every round evicts
    the others' prefixes to host, and the next round onboards them instead of recomputing."""
    name = "llama-gqa4-hd64"
    systems = _prompts(21, [16, 16, 16, 16])
    tails = _prompts(22, [3] * 8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model_dirs[name], block_size=4, num_kv_blocks=12, device="cpu", watermark=0.0,
             host_kv_blocks=64, max_num_seqs=1) as llm:
        for rnd in range(2):
            for i, system in enumerate(systems):
                _check_greedy(llm, hf_models[name], [system + tails[rnd * 4 + i]], f"round {rnd}", params)
        stats = llm.stats()
        host = _host(llm)
        assert stats["offloaded_blocks"] > 0 and stats["onboarded_blocks"] > 0
        assert stats["host_hit_tokens"] == host.host_hit_tokens > 0
        assert host.onboarded_blocks == stats["onboarded_blocks"]
        _assert_all_freed(llm)


def test_preemption_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="sometimes")


def test_host_tier_options_need_the_embedded_node(model_dirs: dict[str, Path]) -> None:
    from engine.llm_engine import EngineError

    with pytest.raises(EngineError, match="embedded node's host tier"):
        LLM(model_dirs["llama-gqa4-hd64"], block_manager="127.0.0.1:1", host_kv_blocks=8)
