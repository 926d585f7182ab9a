"""CPU RMSNorm, optionally fused with the residual add before it: one pass over each row.

A decoder layer normalises twice, each time right after adding a sublayer's output to the
residual stream. As torch calls that is ~7 ops per norm (add, pow, mean, add eps, rsqrt, two
multiplies), each a dispatch of a few µs and, at prefill sizes, a pass over memory: on a 30-layer
model ~400 calls a step. Here it is one call per norm: `residual += delta` in place (the same
float32 add, bit for bit) and `out = weight * residual / rms(residual)`, with the row's sum of
squares accumulated in float64 (torch reduces float32 in its own order: the two agree to
float32 rounding). float32 only: the model's CPU fast path (`compute_node.model.model`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernels.cpu._cache import njit_cached
from kernels.cpu._dense import check_rows, rows_f32


@njit_cached(fastmath={"reassoc", "contract"})
def _rms_norm(x, delta, weight, eps, out):
    # x: [rows, hidden] float32, updated to x + delta when delta has rows (else left as is);
    # delta: [rows, hidden] or [0, hidden]; weight: [hidden]; out: [rows, hidden]
    hidden = x.shape[1]
    add = delta.shape[0] != 0
    for r in range(x.shape[0]):
        row = x[r]
        if add:
            d = delta[r]
            for j in range(hidden):
                row[j] = row[j] + d[j]
        total = 0.0
        for j in range(hidden):
            v = np.float64(row[j])
            total += v * v
        inv = np.float32(1.0 / math.sqrt(total / hidden + eps))
        o = out[r]
        for j in range(hidden):
            o[j] = weight[j] * (row[j] * inv)


_NO_DELTA = np.zeros((0, 1), np.float32)


def rms_norm(x: Any, weight: Any, eps: float, out: Any | None = None, *, residual_delta: Any | None = None) -> Any:
    """`weight * x / sqrt(mean(x**2) + eps)` over the last dim of float32 `x` `[rows, hidden]`
    (CPU tensors or arrays, C-contiguous). With `residual_delta` (same shape), first
    `x += residual_delta` in place (the residual stream moves on) and normalise the sum.
    Returns `out` (a new tensor/array like `x` when None)."""
    xa = rows_f32("x", x)
    rows, hidden = xa.shape
    w = rows_f32("weight", weight, ndim=1)
    check_rows("weight", w, (hidden,))
    delta = _NO_DELTA
    if residual_delta is not None:
        delta = rows_f32("residual_delta", residual_delta)
        check_rows("residual_delta", delta, (rows, hidden))
    if out is None:
        out = x.new_empty(x.shape) if hasattr(x, "new_empty") else np.empty_like(xa)
    o = rows_f32("out", out)
    check_rows("out", o, (rows, hidden))
    if rows:
        _rms_norm(xa, delta, w, float(eps), o)
    return out
