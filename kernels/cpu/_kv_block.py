"""Numba helpers of the tiled CPU prefill kernel: a key tile's K (transposed) and V gathered
from its blocks into contiguous float32 scratch, and the two products of one (query tile, key
tile) pair written so that LLVM vectorises and register-blocks them.

Why a separate formulation from `_tile.py`'s: decode has one query row per query head, so each
key is used `group` times and the per-row dot product (`score_tile`) is as good as anything —
the K/V bytes dominate. Prefill has `QUERY_TILE x group` rows per key: the work is a small
matrix product, and as per-row dot products (a horizontal sum per key, the online-softmax
rescale per 16-key block) it ran at ~6 G multiply-adds/s on two cores. Here the products are
four query rows at a time, so that each K/V vector loaded feeds four FMAs (scores: four dot
products per key; output: four dot products of probabilities with a column of V), and the
softmax rescale happens once per key tile (`KEY_TILE` keys: several blocks) instead of once
per block.
"""

from __future__ import annotations

import numpy as np

from kernels.cpu._cache import njit_cached
from kernels.cpu._tile import FASTMATH, exp_f32, kv_tile


@njit_cached(fastmath=FASTMATH)
def gather_kv(key_cache, value_cache, kv_kind, table_row, kv_head, first_block, num_keys,
              k, vt, k_scratch, k_bits, v_scratch, v_bits):
    """Keys `first_block * block_size …` (`num_keys` of them, whole blocks but the last) of one
    KV head as float32: K rows `k[t, d]`, V transposed `vt[d, t]` (the two products' layouts).

    k: [KEY_TILE, head_dim]; vt: [head_dim, KEY_TILE]; *_scratch/*_bits: one block's widening
    scratch and its uint32 alias (`_tile.kv_tile`).
    """
    block_size = key_cache.shape[2]
    head_dim = k.shape[1]
    t0 = 0
    i = first_block
    while t0 < num_keys:
        n = min(block_size, num_keys - t0)
        block = table_row[i]
        keys = kv_tile(key_cache, block, kv_head, n, kv_kind, k_scratch, k_bits)
        values = kv_tile(value_cache, block, kv_head, n, kv_kind, v_scratch, v_bits)
        for t in range(n):
            src, dst = keys[t], k[t0 + t]
            for d in range(head_dim):
                dst[d] = src[d]
            src = values[t]
            for d in range(head_dim):
                vt[d, t0 + t] = src[d]
        t0 += n
        i += 1


@njit_cached(fastmath=FASTMATH)
def score_rows(q, r0, nr, k, num_keys, s, spare):
    """s[r, t] = q[r] · k[t] for rows r0 … r0 + nr - 1 (nr ≤ 4) and t < num_keys.

    Four dot products per key share each loaded `k[t]` vector (measured: ~3x the per-row dot
    product, ~2x an outer-product update of the score rows). With fewer than four rows, the
    missing ones recompute row r0 into the scratch rows `spare + 1 …` of s (written, never
    read), so the loop body has no branch.
    """
    head_dim = q.shape[1]
    r1 = r0 + 1 if nr > 1 else spare + 1
    r2 = r0 + 2 if nr > 2 else spare + 2
    r3 = r0 + 3 if nr > 3 else spare + 3
    q0 = q[r0]
    q1 = q[r1] if nr > 1 else q0
    q2 = q[r2] if nr > 2 else q0
    q3 = q[r3] if nr > 3 else q0
    for t in range(num_keys):
        kr = k[t]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for d in range(head_dim):
            x = kr[d]
            a0 += q0[d] * x
            a1 += q1[d] * x
            a2 += q2[d] * x
            a3 += q3[d] * x
        s[r0, t] = a0
        s[r1, t] = a1
        s[r2, t] = a2
        s[r3, t] = a3


@njit_cached(fastmath=FASTMATH)
def softmax_rows(s, r, visible, m, l, acc):
    """Online-softmax update of row r with its logits `s[r, :visible]` (overwritten with the
    probabilities): new running max, rescale of l[r] and acc[r] by exp(m_old - m_new)."""
    p = s[r]
    tile_max = p[0]
    for t in range(1, visible):
        tile_max = max(tile_max, p[t])
    m_new = max(m[r], tile_max)
    alpha = exp_f32(m[r] - m_new)
    total = np.float32(0.0)
    for t in range(visible):
        e = exp_f32(p[t] - m_new)
        p[t] = e
        total += e
    l[r] = l[r] * alpha + total
    m[r] = m_new
    if alpha != 1.0:
        a = acc[r]
        for d in range(a.shape[0]):
            a[d] *= alpha


@njit_cached(fastmath=FASTMATH)
def accumulate_rows(p, r0, nr, visible, vt, acc):
    """acc[r, d] += p[r, :visible[r]] · vt[d, :visible[r]] for rows r0 … r0 + nr - 1 (nr ≤ 4).

    The same four-dot-products-per-loaded-vector shape as `score_rows`, over keys instead of
    dimensions (V transposed): measured faster than updating four accumulator rows per value
    row, whose loads and stores LLVM cannot keep in registers (the rows might alias). The four
    rows share the keys all of them see (`visible[r0]`, the shortest); each row adds the rest
    of its own alone (on a diagonal tile, a key or two), so no row reads a value it must not
    see (0 * NaN would still be NaN). Rows past nr recompute row r0 and are discarded.
    """
    head_dim = vt.shape[0]
    common = visible[r0]
    p0 = p[r0]
    p1 = p[r0 + 1] if nr > 1 else p0
    p2 = p[r0 + 2] if nr > 2 else p0
    p3 = p[r0 + 3] if nr > 3 else p0
    for d in range(head_dim):
        vr = vt[d]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for t in range(common):
            x = vr[t]
            a0 += p0[t] * x
            a1 += p1[t] * x
            a2 += p2[t] * x
            a3 += p3[t] * x
        acc[r0, d] += a0
        if nr > 1:
            acc[r0 + 1, d] += a1
        if nr > 2:
            acc[r0 + 2, d] += a2
        if nr > 3:
            acc[r0 + 3, d] += a3
    for r in range(r0 + 1, r0 + nr):
        if visible[r] > common:
            pr = p[r]
            for d in range(head_dim):
                vr = vt[d]
                extra = np.float32(0.0)
                for t in range(common, visible[r]):
                    extra += pr[t] * vr[t]
                acc[r, d] += extra
