"""Prefill timing for bench/gpu_check.py (issue 22): the paged FA2-class prefill vs torch SDPA.

One layer of an 8k-token prompt (32 query / 8 KV heads, head dim 128, fp16, block size 16,
shuffled table): the paged kernel over the whole prompt as one chunk; torch SDPA (flash
backend where torch offers it for these inputs) over the same K/V gathered into contiguous
`[1, heads, tokens, head_dim]` tensors outside the timing, causal; their ratio (goal: paged
<= 1.2x SDPA). Then the chunked-prefill path: the same prompt in chunks of 512 tokens, each
attending to the cached prefix plus itself, as the engine schedules it; its tokens/s.
The pure parts (chunking, FLOP count, the row and its markdown) run without a GPU and are
tested in tests/kernels/test_cuda_gpu_check.py.
"""

from __future__ import annotations

import math
from typing import Any

PROMPT_TOKENS = 8192
CHUNK_TOKENS = 512
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GOAL_RATIO = 1.2


def chunk_bounds(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """[begin, end) of each chunk of a `prompt`-token prefill, in order."""
    if prompt < 0 or chunk < 1:
        raise ValueError("prompt must be >= 0 and chunk >= 1")
    return [(b, min(b + chunk, prompt)) for b in range(0, prompt, chunk)]


def causal_flops(tokens: int, heads: int, head_dim: int, prefix: int = 0) -> float:
    """Multiply-add FLOPs (x2) of causal attention: `tokens` queries after `prefix` cached
    tokens, each seeing the prefix and the chunk up to itself; Q·Kᵀ and P·V."""
    pairs = tokens * prefix + tokens * (tokens + 1) / 2
    return 4.0 * heads * head_dim * pairs


def prefill_row(paged_ms: float, sdpa_ms: float | None, chunked_ms: float,
                prompt: int = PROMPT_TOKENS, chunk: int = CHUNK_TOKENS) -> dict[str, Any]:
    """The report row of one measurement."""
    flops = causal_flops(prompt, NUM_HEADS, HEAD_DIM)
    return {"prompt_tokens": prompt, "paged_ms": paged_ms,
            "paged_tflops": flops / (paged_ms * 1e-3) / 1e12,
            "sdpa_ms": sdpa_ms,
            "ratio_vs_sdpa": paged_ms / sdpa_ms if sdpa_ms else None,
            "goal_ratio": GOAL_RATIO, "chunk_tokens": chunk, "chunked_ms": chunked_ms,
            "chunked_tokens_per_s": prompt / (chunked_ms * 1e-3)}


def prefill_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown section of the prefill rows (empty when none)."""
    if not rows:
        return []
    lines = [f"## Prefill attention, one layer, fp16, {NUM_HEADS} q / {NUM_KV_HEADS} KV heads, "
             f"head dim {HEAD_DIM}, block {BLOCK_SIZE}", "",
             "| prompt | paged ms | paged TFLOP/s | SDPA ms | paged ÷ SDPA (goal <= 1.2) | "
             "chunk | chunked ms | chunked tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = "-" if r["sdpa_ms"] is None else f"{r['sdpa_ms']:.3f}"
        ratio = "-" if r["ratio_vs_sdpa"] is None else f"{r['ratio_vs_sdpa']:.2f}"
        lines.append(f"| {r['prompt_tokens']} | {r['paged_ms']:.3f} | {r['paged_tflops']:.0f} | "
                     f"{sdpa} | {ratio} | {r['chunk_tokens']} | {r['chunked_ms']:.3f} | "
                     f"{r['chunked_tokens_per_s']:.0f} |")
    lines.append("")
    return lines


def bench_prefill(torch: Any, time_events: Any, max_reps: int, log: Any) -> list[dict[str, Any]]:
    """Time the paged prefill, SDPA and the chunked path on the GPU (see the module doc)."""
    import torch.nn.functional as F

    import kernels

    n, bs = PROMPT_TOKENS, BLOCK_SIZE
    num_blocks = n // bs
    scale = 1.0 / math.sqrt(HEAD_DIM)
    shape = (num_blocks, NUM_KV_HEADS, bs, HEAD_DIM)
    kc = torch.randn(shape, device="cuda", dtype=torch.float16)
    vc = torch.randn(shape, device="cuda", dtype=torch.float16)
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(1, num_blocks)
    q = torch.randn((n, NUM_HEADS, HEAD_DIM), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    reps = max(3, min(max_reps, 20))
    paged_ms = time_events(torch, lambda _: kernels.paged_prefill_attention(
        q, kc, vc, table, lens, starts, scale, out=out, backend="cuda", max_query_len=n), reps)
    # Chunked: chunk c's queries after the c * 512 cached tokens, its own K/V already written.
    chunk_args = []
    for begin, end in chunk_bounds(n, CHUNK_TOKENS):
        chunk_args.append((q[begin:end], torch.tensor([end], dtype=torch.int32, device="cuda"),
                           torch.tensor([0, end - begin], dtype=torch.int32, device="cuda"),
                           out[begin:end], end - begin))

    def chunked(_: int) -> None:
        for cq, clen, cstarts, cout, m in chunk_args:
            kernels.paged_prefill_attention(cq, kc, vc, table, clen, cstarts, scale, out=cout,
                                            backend="cuda", max_query_len=m)

    chunked_ms = time_events(torch, chunked, max(3, reps // 4))
    # The same K/V, contiguous: [1, kv_heads, tokens, head_dim], gathered once (not timed).
    order = table[0].long()
    k = kc[order].permute(1, 0, 2, 3).reshape(1, NUM_KV_HEADS, n, HEAD_DIM).contiguous()
    v = vc[order].permute(1, 0, 2, 3).reshape(1, NUM_KV_HEADS, n, HEAD_DIM).contiguous()
    qs = q.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, heads, tokens, head_dim]
    group = NUM_HEADS // NUM_KV_HEADS

    def sdpa(k_in: Any, v_in: Any, **kw: Any) -> Any:
        return lambda _: F.scaled_dot_product_attention(qs, k_in, v_in, is_causal=True,
                                                        scale=scale, **kw)

    # Flash with native GQA (torch >= 2.5) reads each KV head once; else the heads repeated.
    attempts = [("flash, GQA", sdpa(k, v, enable_gqa=True)),
                ("flash, K/V heads repeated", sdpa(k.repeat_interleave(group, dim=1),
                                                   v.repeat_interleave(group, dim=1)))]
    sdpa_ms, sdpa_kind = None, "unavailable"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for kind, fn in attempts:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa_ms = time_events(torch, fn, reps)
            sdpa_kind = kind
            break
        except (TypeError, RuntimeError) as exc:
            log(f"SDPA {kind} unavailable: {exc}")
    row = {**prefill_row(paged_ms, sdpa_ms, chunked_ms), "sdpa_kind": sdpa_kind}
    log(f"prefill {n} tokens: paged {paged_ms:.3f} ms ({row['paged_tflops']:.0f} TFLOP/s), "
        f"SDPA ({sdpa_kind}) {sdpa_ms} ms, ratio {row['ratio_vs_sdpa']} (goal <= {GOAL_RATIO}); "
        f"chunked x{CHUNK_TOKENS}: {chunked_ms:.3f} ms, {row['chunked_tokens_per_s']:.0f} tok/s")
    return [row]
