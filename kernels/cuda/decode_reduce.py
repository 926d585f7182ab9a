"""Reduce kernel of split-K decode: merge the partitions' softmax states into the output.

Partition p of (sequence, head) left an unnormalised accumulator `O_p`, its max `m_p` (log2
domain) and its sum `l_p`. With M = max_p m_p the result is
`Σ_p 2^(m_p - M)·O_p / Σ_p 2^(m_p - M)·l_p`. One warp per (sequence, head), four heads per
thread block: lane p reads partition p's (m_p, l_p) (and p+32's), M and the denominator are
warp reductions (xor shuffles), and each lane then accumulates its 4-float slices of the
partitions' accumulators with 16-byte loads, each weight broadcast by one shuffle. Only the
partitions the split kernel wrote (by the same `part_tokens` rule) are read.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int64

from kernels.cuda._host import ADDR, I32
from kernels.cuda._merge import make_store_chunk
from kernels.cuda._ops import ex2, ld_f32, ld_f32x4, ld_s32, shfl_idx, shfl_xor
from kernels.cuda._runtime import device_function, jit_options, launcher
from kernels.cuda._spec import KIND_BYTES, NUM_WARPS, TC_STEP_TOKENS, WARP, AttentionSpec

NEG_INF = float32(-math.inf)
THREADS = WARP * NUM_WARPS  # one warp per (sequence, head)
MAX_PARTS = 2 * WARP  # each lane holds two partitions' states
PART_ALIGN = TC_STEP_TOKENS * NUM_WARPS  # every warp of a partition gets whole steps


@device_function
def part_tokens(seq_len: Any, num_parts: Any) -> Any:
    """Tokens per partition of one sequence: equal shares rounded up to PART_ALIGN."""
    per = (seq_len + num_parts - 1) // num_parts
    return (per + PART_ALIGN - 1) // PART_ALIGN * PART_ALIGN


@device_function
def _part_state(ml_ptr: Any, p: Any, n_parts: Any) -> Any:
    if p < n_parts:
        return ld_f32(ml_ptr + 8 * p), ld_f32(ml_ptr + 8 * p + 4)
    return NEG_INF, float32(0.0)


@cache
def build_reduce_kernel(head_dim: int, num_heads: int, out_kind: str) -> Any:
    chunks = head_dim // 4  # 4-float slices of a row
    out_bytes = KIND_BYTES[out_kind]
    store = make_store_chunk(out_kind, 4)

    def reduce_kernel(out_ptr: Any, tmp_o: Any, tmp_ml: Any, lens_ptr: Any, num_parts: Any) -> None:
        lane = cuda.laneid
        head = cuda.blockIdx.x * NUM_WARPS + (cuda.threadIdx.x >> 5)
        seq = cuda.blockIdx.y
        if head >= num_heads:
            return  # whole warp; no barrier in this kernel
        seq_len = ld_s32(lens_ptr + 4 * seq)
        n_parts = 0  # a zero length (a padded row of a graph bucket): the output is zero
        if seq_len > 0:
            per = part_tokens(seq_len, num_parts)
            n_parts = (seq_len + per - 1) // per  # partitions the split kernel wrote
        row = int64(seq) * num_heads + head
        # tmp_ml: [num_seqs, num_heads, num_parts, 2]; tmp_o: [..., num_parts, head_dim]
        ml = tmp_ml + row * num_parts * 8
        m_a, l_a = _part_state(ml, lane, n_parts)
        m_b, l_b = _part_state(ml, lane + WARP, n_parts)
        big = max(m_a, m_b)
        for mask in (16, 8, 4, 2, 1):
            big = max(big, shfl_xor(big, mask))
        m_use = big if big != NEG_INF else float32(0.0)
        w_a = ex2(m_a - m_use)  # 0 for partitions past n_parts (m = -inf)
        w_b = ex2(m_b - m_use)
        total = w_a * l_a + w_b * l_b
        for mask in (16, 8, 4, 2, 1):
            total += shfl_xor(total, mask)
        inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
        vals = cuda.local.array(4, float32)
        base = tmp_o + row * num_parts * (4 * head_dim)
        for c0 in range(0, chunks, WARP):  # warp-uniform: every lane takes the shuffles
            c = c0 + lane
            a0, a1, a2, a3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
            for p in range(n_parts):
                w = shfl_idx(w_a if p < WARP else w_b, p & (WARP - 1))
                if c < chunks:
                    x = ld_f32x4(base + p * (4 * head_dim) + 16 * c)
                    a0 += w * x[0]
                    a1 += w * x[1]
                    a2 += w * x[2]
                    a3 += w * x[3]
            if c < chunks:
                vals[0], vals[1], vals[2], vals[3] = a0 * inv, a1 * inv, a2 * inv, a3 * inv
                # out: [num_seqs, num_heads, head_dim]
                store(out_ptr + row * (head_dim * out_bytes) + c * (4 * out_bytes), vals)

    return reduce_kernel


REDUCE_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, I32)


@cache
def reduce_kernel(head_dim: int, num_heads: int, out_kind: str) -> Any:
    return cuda.jit(REDUCE_SIGNATURE, **jit_options((THREADS, 1)))(
        build_reduce_kernel(head_dim, num_heads, out_kind))


def launch_reduce(spec: AttentionSpec, num_seqs: int, num_parts: int, out: Any, tmp_o: Any,
                  tmp_ml: Any, lens: Any, stream: Any) -> None:
    """Merge `num_parts` partials per (sequence, head) into `out` (all device addresses)."""
    if num_parts > MAX_PARTS:
        raise ValueError(f"num_parts {num_parts} > {MAX_PARTS}")
    kernel = reduce_kernel(spec.head_dim, spec.num_heads, spec.out_kind)
    grid = (math.ceil(spec.num_heads / NUM_WARPS), num_seqs)
    launcher(kernel, grid, THREADS, stream)(out, tmp_o, tmp_ml, lens, num_parts)
