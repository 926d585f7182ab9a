"""Reduce kernel for split-K decode: merge per-partition softmax states into the output.

Partition p of (sequence, head) left an unnormalised accumulator `acc_p = Σ exp(s - m_p)·v`,
its max `m_p` and its sum `l_p`. With M = max_p m_p the exact result is
`Σ_p exp(m_p - M)·acc_p / Σ_p exp(m_p - M)·l_p`. One thread block per (sequence, head);
threads split head_dim and each recomputes M and the denominator (a few dozen partitions,
read from L1), which avoids a barrier and a shared-memory round trip.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32

from kernels.cuda._attention_tile import NEG_INF
from kernels.cuda._dtypes import storer
from kernels.cuda._launch import FLOAT32_3D, FLOAT32_4D, INT32_1D, array_type
from kernels.cuda._runtime import jit_options


@cache
def build_reduce_kernel(head_dim: int, out_kind: str, num_threads: int, part_size: int) -> Any:
    store_out = storer(out_kind)

    def reduce_kernel(out: Any, tmp_out: Any, tmp_max: Any, tmp_sum: Any, seq_lens: Any) -> None:
        seq = cuda.blockIdx.x
        head = cuda.blockIdx.y
        num_parts = (seq_lens[seq] + part_size - 1) // part_size
        global_max = NEG_INF
        for p in range(num_parts):
            global_max = max(global_max, tmp_max[seq, head, p])
        denom = float32(0.0)
        for p in range(num_parts):
            denom += tmp_sum[seq, head, p] * math.exp(tmp_max[seq, head, p] - global_max)
        for d in range(cuda.threadIdx.x, head_dim, num_threads):
            numer = float32(0.0)
            for p in range(num_parts):
                # tmp_out: [num_seqs, num_heads, max_parts, head_dim]
                numer += tmp_out[seq, head, p, d] * math.exp(tmp_max[seq, head, p] - global_max)
            value = numer / denom if denom > float32(0.0) else float32(0.0)
            out[seq, head, d] = store_out(value)

    return reduce_kernel


def reduce_signature(out_kind: str) -> tuple[Any, ...]:
    return (array_type(out_kind, 3), FLOAT32_4D, FLOAT32_3D, FLOAT32_3D, INT32_1D)


@cache
def reduce_kernel(head_dim: int, out_kind: str, num_threads: int, part_size: int) -> Any:
    return cuda.jit(**jit_options())(build_reduce_kernel(head_dim, out_kind, num_threads, part_size))

