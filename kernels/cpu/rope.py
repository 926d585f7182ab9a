"""CPU rotary embedding of a step's fused q/k/v projection: q and k rotated, v split off, in
one pass.

The qkv matmul's output row holds every query head, then every KV head's key, then value. As
torch calls, rotating q and k is 4 ops each (two multiplies, a roll, an add) on strided views,
and the kernels then want contiguous q, k and v: ~10 calls a layer, each a pass at prefill
sizes. Here one call reads the row once and writes q, k (rotated) and v (copied) contiguous.

The rotation is Llama / Qwen's half-split ("rotate_half") one, with each position's angles'
cosines and sines `[rows, head_dim // 2]` computed once per step:
`out[i] = x[i] * cos[i] - x[i + half] * sin[i]`, `out[i + half] = x[i + half] * cos[i] + x[i] * sin[i]`,
transformers' `x * cos + rotate_half(x) * sin` up to float32 rounding (a multiply-add may be fused).
"""

from __future__ import annotations

from typing import Any

from kernels._validate import KernelInputError
from kernels.cpu._cache import njit_cached
from kernels.cpu._dense import check_rows, rows_f32


@njit_cached(fastmath={"contract"})
def _rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, q, k, v):
    # qkv: [rows, (num_heads + 2 * num_kv_heads) * head_dim]; cos/sin: [rows, head_dim // 2]
    # q: [rows, num_heads, head_dim]; k, v: [rows, num_kv_heads, head_dim] (all float32)
    head_dim = q.shape[2]
    half = head_dim // 2
    for r in range(qkv.shape[0]):
        src = qkv[r]
        c = cos[r]
        s = sin[r]
        for h in range(num_heads + num_kv_heads):
            x = src[h * head_dim:(h + 1) * head_dim]
            dst = q[r, h] if h < num_heads else k[r, h - num_heads]
            for i in range(half):
                x0 = x[i]
                x1 = x[i + half]
                dst[i] = x0 * c[i] - x1 * s[i]
                dst[i + half] = x1 * c[i] + x0 * s[i]
        base = (num_heads + num_kv_heads) * head_dim
        for h in range(num_kv_heads):
            dst = v[r, h]
            for i in range(head_dim):
                dst[i] = src[base + h * head_dim + i]


def rope_qkv(qkv: Any, cos: Any, sin: Any, num_heads: int, num_kv_heads: int, head_dim: int,
             q: Any, k: Any, v: Any) -> None:
    """Rotate the query and key heads of float32 `qkv` `[rows, (num_heads + 2 * num_kv_heads)
    * head_dim]` by `cos`/`sin` `[rows, head_dim // 2]` into `q` `[rows, num_heads, head_dim]`
    and `k` `[rows, num_kv_heads, head_dim]`, and copy the value heads into `v` (same shape as
    `k`). Every array float32, C-contiguous, on the host."""
    if head_dim < 2 or head_dim % 2:
        raise KernelInputError(f"head_dim must be even and >= 2, got {head_dim}")
    if num_heads < 1 or num_kv_heads < 1:
        raise KernelInputError(f"need at least one query and one KV head, got {num_heads} and {num_kv_heads}")
    x = rows_f32("qkv", qkv)
    rows = x.shape[0]
    check_rows("qkv", x, (rows, (num_heads + 2 * num_kv_heads) * head_dim))
    c = rows_f32("cos", cos)
    s = rows_f32("sin", sin)
    check_rows("cos", c, (rows, head_dim // 2))
    check_rows("sin", s, (rows, head_dim // 2))
    qa, ka, va = rows_f32("q", q, ndim=3), rows_f32("k", k, ndim=3), rows_f32("v", v, ndim=3)
    check_rows("q", qa, (rows, num_heads, head_dim))
    check_rows("k", ka, (rows, num_kv_heads, head_dim))
    check_rows("v", va, (rows, num_kv_heads, head_dim))
    if not rows:
        return
    _rope_qkv(x, c, s, num_heads, num_kv_heads, qa, ka, va)
