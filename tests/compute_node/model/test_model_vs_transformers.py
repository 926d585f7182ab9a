"""The runner against transformers (float32, CPU): greedy generation token for token, and the
logits / final hidden states of one forward, for random-weight tiny Llama, Qwen2 and Qwen3.

The schedule mixes everything a real step mixes: prefills and decodes in one `execute`, prompts
crossing block boundaries, a one-token prompt, a prompt computed in chunks over several steps,
and a prompt whose first blocks are another sequence's (a prefix-cache hit: only the suffix is
computed, attending to K/V that the other sequence wrote).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from compute_node.model import ModelRunner, SeqWork
from tests.compute_node.model.model_helpers import (
    Request,
    compare_greedy,
    hf_greedy,
    load_hf,
    run_schedule,
    tiny_model_dir,
)

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# GQA ratios 1, 4, 8 and 2; head dims 64 and 128; tied and untied; biases; Llama 3 RoPE; shards.
MODELS = {
    "llama-gqa4-hd64-untied": {
        "arch": "llama", "num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 1, "head_dim": 64,
        "intermediate_size": 256, "vocab_size": 512,
    },
    "qwen2-gqa1-hd128-tied": {
        "arch": "qwen2", "num_layers": 2, "hidden_size": 128, "num_heads": 2, "num_kv_heads": 2, "head_dim": 128,
        "intermediate_size": 256, "vocab_size": 384, "tie_word_embeddings": True,
    },
    "qwen3-gqa8-hd64-untied": {
        "arch": "qwen3", "num_layers": 1, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 1, "head_dim": 64,
        "intermediate_size": 384, "vocab_size": 1000,
    },
    "qwen3-gqa2-hd128-tied-bias": {
        "arch": "qwen3", "num_layers": 1, "hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "head_dim": 128,
        "intermediate_size": 256, "vocab_size": 300, "tie_word_embeddings": True, "attention_bias": True,
    },
    "llama-llama3rope-sharded-bias": {
        "arch": "llama", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
        "intermediate_size": 128, "vocab_size": 300, "sharded": True, "tie_word_embeddings": True,
        "attention_bias": True, "rope_scaling": LLAMA3_ROPE,
    },
}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers_generate(model_root: Path, name: str) -> None:
    spec = dict(MODELS[name])
    model_dir = tiny_model_dir(model_root, spec.pop("arch"), seed=7, **spec)
    vocab = spec["vocab_size"]
    rng = random.Random(name)
    base = _prompt(rng, vocab, 13)
    requests = [
        Request(base, 10),                                            # 13 tokens over 4 blocks of 4
        Request(_prompt(rng, vocab, 6), 12),
        Request(_prompt(rng, vocab, 23), 6, admit_step=2, chunk_size=7),  # chunked mid-block: 7+7+7+2
        Request(_prompt(rng, vocab, 1), 8, admit_step=3),               # a one-token prompt
        Request(base[:12] + _prompt(rng, vocab, 5), 9, admit_step=2,     # prefix hit: 3 blocks shared
                share_from=0, shared_blocks=3),
    ]
    runner = ModelRunner(model_dir, block_size=4, num_blocks=128, device="cpu")
    outputs = run_schedule(runner, requests)
    hf = load_hf(model_dir)
    matched = 0
    for i, (request, ours) in enumerate(zip(requests, outputs)):
        matched += compare_greedy(ours, hf_greedy(hf, request.prompt, request.max_new_tokens), f"{name} seq {i}")
    # A near-tie may end a comparison early, but most of the tokens must have been compared.
    assert matched >= 0.8 * sum(r.max_new_tokens for r in requests)


@pytest.mark.parametrize("name", ["llama-gqa4-hd64-untied", "qwen2-gqa1-hd128-tied", "qwen3-gqa8-hd64-untied"])
def test_one_forward_logits_and_hidden_match(model_root: Path, name: str) -> None:
    spec = dict(MODELS[name])
    model_dir = tiny_model_dir(model_root, spec.pop("arch"), seed=7, **spec)
    rng = random.Random(1)
    prompts = [_prompt(rng, spec["vocab_size"], n) for n in (11, 1, 26)]
    runner = ModelRunner(model_dir, block_size=8, num_blocks=16, device="cpu")
    tables = [[0, 1], [2], [3, 5, 4, 6]]
    ours = runner.debug_forward([SeqWork(f"s{i}", p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))])
    hf = load_hf(model_dir)
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p]), output_hidden_states=True)
        rows = slice(start, start + len(p))
        torch.testing.assert_close(ours.hidden_states[rows], ref.hidden_states[-1][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.logits[rows], ref.logits[0], rtol=1e-4, atol=1e-4)
        start += len(p)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_load_and_generate(model_root: Path, dtype: str) -> None:
    """fp32 checkpoint run in fp16/bf16 (pool in that dtype too), and a checkpoint saved in that
    dtype loaded at its own dtype: logits stay close to the fp32 ones, greedy runs."""
    spec = dict(MODELS["llama-gqa4-hd64-untied"])
    model_dir = tiny_model_dir(model_root, spec.pop("arch"), seed=7, **spec)
    half_dir = tiny_model_dir(model_root, "llama", seed=7, **{**spec, "dtype": dtype})
    prompt = _prompt(random.Random(3), spec["vocab_size"], 19)
    reference = ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu").debug_forward(
        [SeqWork("a", prompt, 0, list(range(5)))]
    ).logits
    for runner in (
        ModelRunner(model_dir, block_size=4, num_blocks=32, dtype=dtype, device="cpu"),
        ModelRunner(half_dir, block_size=4, num_blocks=32, device="cpu"),
    ):
        assert runner.dtype == dtype and runner.pool.key_caches[0].dtype == getattr(torch, dtype)
        logits = runner.debug_forward([SeqWork("a", prompt, 0, list(range(5)))]).logits
        cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
        assert float(cosine.min()) > 0.99, cosine
        outputs = run_schedule(runner, [Request(prompt, 6), Request(prompt[:7], 6, admit_step=1)])
        assert all(len(o) == 6 and all(0 <= t < spec["vocab_size"] for t in o) for o in outputs)
