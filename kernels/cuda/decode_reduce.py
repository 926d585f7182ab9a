"""Reduce kernel of split-K decode: merge the partitions' softmax states into the output.

Partition p of (sequence, head) left an unnormalised accumulator `O_p`, its max `m_p` (log2
domain) and its sum `l_p`. With M = max_p m_p the result is
`Σ_p 2^(m_p - M)·O_p / Σ_p 2^(m_p - M)·l_p`. One warp per (sequence, head), four heads per
thread block: lane p reads partition p's (m_p, l_p) (and p+32's), M and the denominator are
warp reductions (xor shuffles), and each lane then accumulates its 4-float slices of the
partitions' accumulators with 16-byte loads, each weight broadcast by one shuffle.

Sequences have different partition counts (a common chunk size: `decode_policy`): the split
kernel's work list gives sequence s the work items first[s] .. first[s+1]-1, and the partials
of item w sit at row w of the scratch ([items, num_heads, head_dim] + [..., 2]). Only the
partitions the split kernel wrote (by the same `part_tokens` rule) are read.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int64

from kernels.cuda import decode_policy
from kernels.cuda._host import ADDR
from kernels.cuda._kernel_cache import compile_kernel
from kernels.cuda._merge import make_store_chunk
from kernels.cuda._ops import ex2, ld_f32, ld_f32x4, ld_s32, shfl_idx, shfl_xor
from kernels.cuda._runtime import device_function, launcher
from kernels.cuda._spec import KIND_BYTES, NUM_WARPS, TC_STEP_TOKENS, WARP, AttentionSpec

NEG_INF = float32(-math.inf)
THREADS = WARP * NUM_WARPS  # one warp per (sequence, head)
MAX_PARTS = 2 * WARP  # each lane holds two partitions' states
PART_ALIGN = TC_STEP_TOKENS * NUM_WARPS  # every warp of a partition gets whole steps
if (MAX_PARTS, PART_ALIGN) != (decode_policy.MAX_PARTS, decode_policy.PART_ALIGN):
    raise ImportError("decode_policy's partition limits disagree with the kernels'")


@device_function
def part_tokens(seq_len: Any, num_parts: Any) -> Any:
    """Tokens per partition of one sequence: equal shares rounded up to PART_ALIGN."""
    per = (seq_len + num_parts - 1) // num_parts
    return (per + PART_ALIGN - 1) // PART_ALIGN * PART_ALIGN


@device_function
def _part_state(ml_ptr: Any, p: Any, n_parts: Any, stride: Any) -> Any:
    if p < n_parts:
        return ld_f32(ml_ptr + stride * p), ld_f32(ml_ptr + stride * p + 4)
    return NEG_INF, float32(0.0)


@cache
def build_reduce_kernel(head_dim: int, num_heads: int, out_kind: str) -> Any:
    chunks = head_dim // 4  # 4-float slices of a row
    out_bytes = KIND_BYTES[out_kind]
    store = make_store_chunk(out_kind, 4)

    def reduce_kernel(out_ptr: Any, tmp_o: Any, tmp_ml: Any, lens_ptr: Any,
                      first_ptr: Any) -> None:
        lane = cuda.laneid
        head = cuda.blockIdx.x * NUM_WARPS + (cuda.threadIdx.x >> 5)
        seq = cuda.blockIdx.y
        if head >= num_heads:
            return  # whole warp; no barrier in this kernel
        seq_len = ld_s32(lens_ptr + 4 * seq)
        first = ld_s32(first_ptr + 4 * seq)  # the sequence's work items: first .. next - 1
        num_items = ld_s32(first_ptr + 4 * seq + 4) - first
        n_parts = 0  # a zero length (a padded row of a graph bucket): the output is zero
        if seq_len > 0 and num_items > 0:
            per = part_tokens(seq_len, num_items)
            n_parts = (seq_len + per - 1) // per  # partitions the split kernel wrote
        # tmp_ml: [items, num_heads, 2]; tmp_o: [items, num_heads, head_dim]
        row = int64(first) * num_heads + head  # partition p's row: row + p * num_heads
        ml = tmp_ml + row * 8
        m_a, l_a = _part_state(ml, lane, n_parts, num_heads * 8)
        m_b, l_b = _part_state(ml, lane + WARP, n_parts, num_heads * 8)
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
        base = tmp_o + row * (4 * head_dim)
        o_stride = num_heads * (4 * head_dim)  # bytes from one partition's row to the next
        for c0 in range(0, chunks, WARP):  # warp-uniform: every lane takes the shuffles
            c = c0 + lane
            a0, a1, a2, a3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
            for p in range(n_parts):
                w = shfl_idx(w_a if p < WARP else w_b, p & (WARP - 1))
                if c < chunks:
                    x = ld_f32x4(base + p * o_stride + 16 * c)
                    a0 += w * x[0]
                    a1 += w * x[1]
                    a2 += w * x[2]
                    a3 += w * x[3]
            if c < chunks:
                vals[0], vals[1], vals[2], vals[3] = a0 * inv, a1 * inv, a2 * inv, a3 * inv
                # out: [num_seqs, num_heads, head_dim]
                out_row = int64(seq) * num_heads + head
                store(out_ptr + out_row * (head_dim * out_bytes) + c * (4 * out_bytes), vals)

    return reduce_kernel


REDUCE_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR)


@cache
def reduce_kernel(head_dim: int, num_heads: int, out_kind: str) -> Any:
    """The reduce kernel of a geometry (compiled or loaded as `decode.decode_kernel`)."""
    return compile_kernel(build_reduce_kernel(head_dim, num_heads, out_kind), REDUCE_SIGNATURE,
                          (THREADS, 1), f"reduce {head_dim} {num_heads} {out_kind}")


def launch_reduce(spec: AttentionSpec, num_seqs: int, out: Any, tmp_o: Any, tmp_ml: Any,
                  lens: Any, first: Any, stream: Any) -> None:
    """Merge each sequence's partials (work items first[s] .. first[s+1]-1, at most
    MAX_PARTS) into `out` (all device addresses)."""
    kernel = reduce_kernel(spec.head_dim, spec.num_heads, spec.out_kind)
    grid = (math.ceil(spec.num_heads / NUM_WARPS), num_seqs)
    launcher(kernel, grid, THREADS, stream)(out, tmp_o, tmp_ml, lens, first)
