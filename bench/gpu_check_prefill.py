"""Prefill cells of the GPU check (review §4.3 items 10-11): the paged FA2-class prefill vs
torch SDPA (flash), kernel-only.

1. One layer of an 8k-token prompt as one chunk (32 query / 8 KV heads, block 16, shuffled
   table) in fp16 d128, bf16 d128 and fp16 / bf16 d64; SDPA flash (native GQA where torch has
   it, else K/V heads repeated) over the same K/V gathered into contiguous tensors outside the
   timing, causal; their ratio (issue 43's goal: <= 1.0x). Plus the chunked path: the same
   prompt in chunks of 512, each attending to the cached prefix plus itself.
2. A short chunk after a cached prefix (chunked prefill, prefix hits, speculative decode):
   q_len in {16, 64, 512} after 8k and 32k tokens, B in {1, 16}; SDPA flash non-causal over
   the whole prefix + chunk (an upper bound of the work: q_len^2 / 2 pairs more than causal;
   `sdpa_kind` says which call ran).

Times are `gpu_timing.time_call`'s (kernel-only, back-to-back, host µs). The pure parts
(chunking, FLOP counts) are tested in tests/kernels/test_cuda_gpu_check.py.
"""

from __future__ import annotations

import math
from typing import Any

from gpu_sizes import Sizes
from gpu_timing import Timer, time_call

CHUNK_TOKENS = 512


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


class PrefillBench:
    def __init__(self, torch: Any, timer: Timer, device: str, sizes: Sizes) -> None:
        self.torch, self.timer, self.device, self.sizes = torch, timer, device, sizes

    def inputs(self, batch: int, prefix: int, q_len: int, dtype: str, head_dim: int) -> dict[str, Any]:
        """Paged K/V for `batch` sequences of prefix + q_len tokens (shuffled tables), the
        chunk's queries, and the same K/V contiguous for SDPA."""
        torch, s, dev = self.torch, self.sizes, self.device
        total = prefix + q_len
        per_seq = -(-total // s.block_size)
        tdtype = getattr(torch, dtype)
        shape = (batch * per_seq, s.kv_heads, s.block_size, head_dim)
        kc = torch.randn(shape, device=dev, dtype=tdtype)
        vc = torch.randn(shape, device=dev, dtype=tdtype)
        table = torch.randperm(batch * per_seq, device=dev).to(torch.int32).view(batch, per_seq)
        q = torch.randn((batch * q_len, s.heads, head_dim), device=dev, dtype=tdtype)
        starts = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
        lens = torch.full((batch,), total, dtype=torch.int32, device=dev)

        def contiguous(cache: Any) -> Any:  # [B, kv_heads, total, d]
            rows = cache[table.long()]  # [B, per_seq, kv, bs, d]
            return rows.permute(0, 2, 1, 3, 4).reshape(batch, s.kv_heads, -1, head_dim)[:, :, :total]

        return {"kc": kc, "vc": vc, "table": table, "q": q, "out": torch.empty_like(q),
                "starts": starts, "lens": lens, "k": contiguous(kc).contiguous(),
                "v": contiguous(vc).contiguous(),
                "qs": q.view(batch, q_len, s.heads, head_dim).transpose(1, 2).contiguous()}

    def paged(self, x: dict[str, Any], q_len: int, head_dim: int) -> Any:
        import kernels

        scale = 1.0 / math.sqrt(head_dim)
        return time_call(self.timer, lambda _: kernels.paged_prefill_attention(
            x["q"], x["kc"], x["vc"], x["table"], x["lens"], x["starts"], scale, out=x["out"],
            backend="cuda", max_query_len=q_len), min(10, self.sizes.max_reps), b2b_calls=5)

    def sdpa(self, x: dict[str, Any], q_len: int, total: int, head_dim: int) -> tuple[Any, str]:
        """(times, kind) of the best SDPA call torch accepts for this shape (module doc)."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        s = self.sizes
        scale = 1.0 / math.sqrt(head_dim)
        qs, k, v = x["qs"], x["k"], x["v"]
        group = s.heads // s.kv_heads
        attempts: list[tuple[str, Any]] = []  # (kind, make the call): built only if tried
        if q_len == total:
            attempts.append(("flash causal, GQA", lambda: lambda _: F.scaled_dot_product_attention(
                qs, k, v, is_causal=True, scale=scale, enable_gqa=True)))
        else:
            # Non-causal over prefix + chunk: at most q_len^2 / 2 pairs more than the lower-right
            # causal mask (3% at 512 after 8k). torch's lower-right CausalBias would import
            # torch._dynamo (~4 s of the run) and is_causal means upper-left for q_len < kv_len.
            attempts.append(("flash non-causal (all of prefix + chunk), GQA",
                             lambda: lambda _: F.scaled_dot_product_attention(qs, k, v, scale=scale,
                                                                              enable_gqa=True)))
        def repeated() -> Any:
            kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return lambda _: F.scaled_dot_product_attention(qs, kr, vr, is_causal=q_len == total,
                                                            scale=scale)

        attempts.append(("flash, K/V heads repeated" + ("" if q_len == total else ", non-causal"),
                         repeated))
        errors = []
        backends = [SDPBackend.FLASH_ATTENTION] if self.device == "cuda" else [SDPBackend.MATH]
        for kind, make in attempts:
            try:
                with sdpa_kernel(backends):
                    return time_call(self.timer, make(), min(10, s.max_reps), b2b_calls=5), kind
            except (TypeError, RuntimeError, ValueError) as exc:
                errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[:80]}")
        raise RuntimeError("no SDPA variant ran: " + "; ".join(errors))

    def cell(self, batch: int, prefix: int, q_len: int, dtype: str, head_dim: int) -> dict[str, Any]:
        s = self.sizes
        total = prefix + q_len
        x = self.inputs(batch, prefix, q_len, dtype, head_dim)
        paged = self.paged(x, q_len, head_dim)
        row: dict[str, Any] = {"batch": batch, "prefix": prefix, "q_len": q_len, "dtype": dtype,
                               "head_dim": head_dim, **paged.as_row("paged_")}
        flops = batch * causal_flops(q_len, s.heads, head_dim, prefix=prefix)
        row["paged_tflops"] = flops / (paged.kernel_us * 1e-6) / 1e12
        try:
            sdpa, kind = self.sdpa(x, q_len, total, head_dim)
            row.update({**sdpa.as_row("sdpa_"), "sdpa_kind": kind,
                        "sdpa_tflops": flops / (sdpa.kernel_us * 1e-6) / 1e12,
                        "paged_vs_sdpa": paged.kernel_us / sdpa.kernel_us})
        except RuntimeError as exc:
            row["sdpa_kind"] = str(exc)[:300]
        if prefix == 0 and dtype == "float16" and head_dim == s.head_dim:
            row.update(self.chunked(x, q_len, head_dim))
        del x
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
        return row

    def chunked(self, x: dict[str, Any], n: int, head_dim: int) -> dict[str, Any]:
        """The prompt in CHUNK_TOKENS chunks, each after the cached part (the engine's path)."""
        import kernels

        torch, dev = self.torch, self.device
        scale = 1.0 / math.sqrt(head_dim)
        args = []
        for begin, end in chunk_bounds(n, min(CHUNK_TOKENS, n)):
            args.append((x["q"][begin:end], torch.tensor([end], dtype=torch.int32, device=dev),
                         torch.tensor([0, end - begin], dtype=torch.int32, device=dev),
                         x["out"][begin:end], end - begin))

        def run(_: int) -> None:
            for cq, clen, cstarts, cout, m in args:
                kernels.paged_prefill_attention(cq, x["kc"], x["vc"], x["table"][:1], clen, cstarts,
                                                scale, out=cout, backend="cuda", max_query_len=m)

        t = time_call(self.timer, run, 3, warmup=1, b2b_calls=3)
        return {"chunk": min(CHUNK_TOKENS, n), "chunked_kernel_us": t.kernel_us,
                "chunked_b2b_us": t.back_to_back_us, "chunked_host_us_per_chunk": t.host_us / len(args)}


def phase_prefill(ctx: Any, bench: PrefillBench) -> None:
    s = bench.sizes
    n = s.prefill_tokens
    for dtype, head_dim in (("float16", s.head_dim), ("bfloat16", s.head_dim),
                            ("float16", 64), ("bfloat16", 64)):
        ctx.cell(f"prompt {n} {dtype} d{head_dim}",
                 lambda dtype=dtype, head_dim=head_dim: bench.cell(1, 0, n, dtype, head_dim))
    for prefix in s.prefix_lens:
        for batch in s.prefix_batches:
            for q_len in s.prefix_q_lens:
                ctx.cell(f"chunk {q_len} after {prefix} B={batch}",
                         lambda p=prefix, b=batch, q=q_len: bench.cell(b, p, q, "float16", s.head_dim))
