"""What `bench_vs_vllm.py` feeds both engines and how it counts: stdlib only, because vLLM's
side runs it in vLLM's own venv, where pagedkv is not installed.

A workload is a list of requests, each a prompt of token ids and a number of new tokens
(greedy, EOS ignored, so every request makes exactly that many). It is drawn from
`random.Random` seeded by the workload name and the repeat, so both sides of one repeat get the
very same prompts, and each repeat gets new ones: a repeat in the same process never finds the
previous one's prompts in the prefix cache (prefix sharing is measured inside one repeat only).

Token ids are drawn from `[FIRST_ID, vocab)`: the first ids of the models this benchmark builds
are special tokens (BOS/EOS/chat markers), which a prompt never holds in the middle.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

FIRST_ID = 4


@dataclass(frozen=True)
class Shape:
    """A model shape the benchmark builds with random weights (`tiny.build_tiny_model` args)."""

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool


SHAPES = {
    # SmolLM-135M: Llama, 30 layers, 9 query / 3 KV heads of 64, vocab 49,152, tied head
    "smollm-135m": Shape("smollm-135m", "llama", 30, 576, 9, 3, 64, 1536, 49152, True),
    # Qwen2.5-0.5B: Qwen2 (q/k/v biases), 24 layers, 14 / 2 heads of 64, vocab 151,936, tied
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 64, 4864, 151936, True),
}

Request = tuple[list[int], int]   # (prompt token ids, new tokens)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def batch(rng: random.Random, vocab: int) -> list[Request]:
    """32 prompts of 16–512 tokens, 64 new tokens each: mixed lengths, nothing shared."""
    return [(_ids(rng, rng.randint(16, 512), vocab), 64) for _ in range(32)]


def shared_prefix(rng: random.Random, vocab: int) -> list[Request]:
    """24 prompts = one 256-token prefix (a system prompt) + 16–64 tokens of their own, 64 new."""
    prefix = _ids(rng, 256, vocab)
    return [(prefix + _ids(rng, rng.randint(16, 64), vocab), 64) for _ in range(24)]


def single(rng: random.Random, vocab: int) -> list[Request]:
    """One 128-token prompt, 128 new tokens: batch-1 latency."""
    return [(_ids(rng, 128, vocab), 128)]


def long_context(rng: random.Random, vocab: int) -> list[Request]:
    """8 prompts of 1,024–2,048 tokens, 64 new each: long prefills, decode over long contexts."""
    return [(_ids(rng, rng.randint(1024, 2048), vocab), 64) for _ in range(8)]


WORKLOADS = {"batch": batch, "shared": shared_prefix, "single": single, "long": long_context}


def make_workload(name: str, repeat: int, vocab: int) -> list[Request]:
    """The requests of workload `name` for repeat `repeat` (the same on every side and run)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    return WORKLOADS[name](random.Random(f"{name}/{repeat}"), vocab)


@dataclass
class RunResult:
    """One side's run of one workload: what `summarize` turns into numbers."""

    seconds: float                       # wall time from the first request added to the last token
    ttft_s: list[float]                  # per request: time from the start to its first token
    outputs: list[list[int]]             # per request, in workload order: the generated token ids


def summarize(requests: list[Request], run: RunResult) -> dict[str, float]:
    """Output tokens per second (counted from the outputs, and checked against what was asked:
    a short output would inflate nothing but would hide a bug), TTFT p50 / max."""
    if len(run.outputs) != len(requests):
        raise ValueError(f"{len(run.outputs)} outputs for {len(requests)} requests")
    for i, ((_, n), out) in enumerate(zip(requests, run.outputs)):
        if len(out) != n:
            raise ValueError(f"request {i} asked for {n} tokens and got {len(out)}")
    generated = sum(len(o) for o in run.outputs)
    return {
        "output_tokens": generated,
        "seconds": run.seconds,
        "tok_per_s": generated / run.seconds,
        "ttft_p50_s": statistics.median(run.ttft_s),
        "ttft_max_s": max(run.ttft_s),
    }


def compare_outputs(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(requests whose greedy outputs are identical, requests)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} outputs")
    return sum(x == y for x, y in zip(a, b)), len(a)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two outputs (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
