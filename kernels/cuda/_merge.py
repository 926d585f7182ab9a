"""The end of every attention kernel: merge the warps' softmax states, store output chunks.

Each warp of a block attended to its own token steps and holds, per query row, a running max
`m_w` (log2 domain), a sum `l_w` and an unnormalised accumulator `O_w`. With M = max_w m_w the
block's result is `Σ_w 2^(m_w - M)·O_w / Σ_w 2^(m_w - M)·l_w` (one-pass kernels) or, unnormalised,
the partial state (M, Σ_w 2^(m_w - M)·l_w, Σ_w 2^(m_w - M)·O_w) a split-K reduce merges later.

The kernel publishes [m_w, l_w] per row to shared memory, each warp stages its accumulators of
one row tile (8 rows), scaled by `row_factor`, into a flat float32 buffer [warp, row, dim] (the
K/V staging buffer, free by then), and all threads sum the warps' copies of `chunk`
contiguous dims and store them with wide stores.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import float32

from kernels.cuda._ops import ex2 as _ex2
from kernels.cuda._ops import f32x2_to_bf16x2, f32x2_to_f16x2, st_f32x4, st_v2, st_v4
from kernels.cuda._runtime import device_function

NEG_INF = float32(-math.inf)


@cache
def make_row_stats(num_warps: int) -> tuple[Any, Any]:
    """Device functions `row_stats(ms, ls, r)` and `row_factor(ms, ls, warp, r, normalize)`."""

    @device_function
    def row_stats(ms: Any, ls: Any, r: Any) -> Any:
        """(M, L, M or 0 if no warp saw a token) of block row r from the published states."""
        big = NEG_INF
        for w in range(num_warps):
            big = max(big, ms[w, r])
        m_use = big if big != NEG_INF else float32(0.0)
        total = float32(0.0)
        for w in range(num_warps):
            total += ls[w, r] * _ex2(ms[w, r] - m_use)  # an idle warp has m = -inf, l = 0
        return big, total, m_use

    @device_function
    def row_factor(ms: Any, ls: Any, warp: Any, r: Any, normalize: Any) -> Any:
        """What warp `warp` multiplies its accumulator of row r by before warps are summed."""
        _big, total, m_use = row_stats(ms, ls, r)
        f = _ex2(ms[warp, r] - m_use)
        if normalize:
            f = f / total if total > float32(0.0) else float32(0.0)
        return f

    return row_stats, row_factor


def chunk_dims(head_dim: int) -> int:
    """Dims one thread sums and stores at the end (8 → a 16-byte fp16 store)."""
    return 8 if head_dim % 8 == 0 else 4


@cache
def make_sum_chunk(chunk: int, num_warps: int, head_dim: int) -> Any:
    @device_function
    def sum_chunk(os: Any, r: Any, d0: Any, vals: Any) -> None:
        """vals = Σ_w os[w, r, d0:d0+chunk] of the flat [warp, 8 rows, head_dim] buffer."""
        for i in range(chunk):
            acc = float32(0.0)
            for w in range(num_warps):
                acc += os[(w * 8 + r) * head_dim + d0 + i]
            vals[i] = acc

    return sum_chunk


@cache
def make_store_chunk(out_kind: str, chunk: int) -> Any:
    """Device function: store `chunk` float32 values as `out_kind` at a chunk-aligned address."""
    pack = f32x2_to_bf16x2 if out_kind == "bf16" else f32x2_to_f16x2

    @device_function
    def store_chunk(addr: Any, vals: Any) -> None:
        if out_kind == "f32":
            for i in range(chunk // 4):
                st_f32x4(addr + 16 * i, vals[4 * i], vals[4 * i + 1], vals[4 * i + 2],
                         vals[4 * i + 3])
        elif chunk == 8:
            st_v4(addr, pack(vals[0], vals[1]), pack(vals[2], vals[3]), pack(vals[4], vals[5]),
                  pack(vals[6], vals[7]))
        else:
            st_v2(addr, pack(vals[0], vals[1]), pack(vals[2], vals[3]))

    return store_chunk
