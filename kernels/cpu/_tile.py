"""Numba helpers shared by the CPU attention kernels: tile widening and one online-softmax step.

The attention kernels walk a sequence's block table one block at a time. For each block they
widen the K (then V) tile of one KV head to a float32 scratch tile, score it against every query
head of the GQA group, and fold the scores into a running max / running sum / unnormalised
accumulator (online softmax). Reading each K/V byte once per KV head — not once per query head —
is what makes the kernels memory-bound rather than compute-bound, as on the GPU.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu._host import KIND_BF16, KIND_F16

# Fast-math without `nnan`/`ninf`: the running max starts at -inf and a NaN in a corrupted
# cache must reach the output instead of being optimised into garbage.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

# 2**112 rescales a float16 exponent (bias 15) placed in a float32 exponent field (bias 127).
_F16_EXP_RESCALE = np.float32(2.0**112)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def load_tile(cache, block, head, num_tokens, kv_kind, tile_f32, tile_u32):
    """Widen `cache[block, head, :num_tokens, :]` to float32 into `tile_f32`.

    `cache` is the uint16 view of a `[num_blocks, num_kv_heads, block_size, head_dim]` cache
    (fp32: two little-endian halves per element); `tile_u32` aliases `tile_f32`.
    fp16 → fp32 is done with integer moves plus one exact multiply so that the loop
    vectorises: shifting the 15 magnitude bits left by 13 puts the fp16 exponent/mantissa into
    the float32 fields, and multiplying by 2**112 fixes the exponent bias — which also turns
    fp16 subnormals into the right float32 values. Inf/NaN (exponent all ones) get the float32
    all-ones exponent first, so the multiply leaves them Inf/NaN.
    """
    head_dim = tile_f32.shape[1]
    if kv_kind == KIND_F16:
        for t in range(num_tokens):
            for d in range(head_dim):
                h = np.uint32(cache[block, head, t, d])
                bits = ((h & 0x8000) << 16) | ((h & 0x7FFF) << 13)
                if (h & 0x7C00) == 0x7C00:
                    bits |= np.uint32(0x7F800000)
                tile_u32[t, d] = bits
            for d in range(head_dim):
                tile_f32[t, d] *= _F16_EXP_RESCALE
    elif kv_kind == KIND_BF16:
        for t in range(num_tokens):
            for d in range(head_dim):
                tile_u32[t, d] = np.uint32(cache[block, head, t, d]) << 16
    else:
        for t in range(num_tokens):
            for d in range(head_dim):
                low = np.uint32(cache[block, head, t, 2 * d])
                tile_u32[t, d] = low | (np.uint32(cache[block, head, t, 2 * d + 1]) << 16)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def score_tile(q, q_row, k_tile, num_tokens, scores, row):
    """scores[row, t] = q[q_row] · k_tile[t] for the first `num_tokens` tokens (q pre-scaled)."""
    head_dim = k_tile.shape[1]
    for t in range(num_tokens):
        dot = np.float32(0.0)
        for d in range(head_dim):
            dot += q[q_row, d] * k_tile[t, d]
        scores[row, t] = dot


@njit(fastmath=FASTMATH, cache=True, inline="always")
def online_softmax_step(scores, row, num_tokens, v_tile, m, l, acc):
    """Fold one block's logits `scores[row, :num_tokens]` into the running state of `row`.

    `m[row]` is the running max, `l[row]` the running sum of exp(logit - m) and `acc[row]` the
    running sum of exp(logit - m) * v. Rescaling by exp(m_old - m_new) keeps every exponent
    ≤ 0, so nothing overflows however large the logits are; m starts at -inf, and the first
    block always has a visible token, so exp(-inf) = 0 wipes the empty initial state.
    """
    block_max = scores[row, 0]
    for t in range(1, num_tokens):
        if scores[row, t] > block_max:
            block_max = scores[row, t]
    m_old = m[row]
    m_new = block_max if block_max > m_old else m_old
    alpha = np.float32(np.exp(m_old - m_new))
    head_dim = acc.shape[1]
    if alpha != 1.0:
        for d in range(head_dim):
            acc[row, d] *= alpha
    total = np.float32(0.0)
    for t in range(num_tokens):
        p = np.float32(np.exp(scores[row, t] - m_new))
        total += p
        for d in range(head_dim):
            acc[row, d] += p * v_tile[t, d]
    l[row] = l[row] * alpha + total
    m[row] = m_new


@njit(fastmath=FASTMATH, cache=True)
def attend_blocks(q_group, key_cache, value_cache, kv_kind, table_row, seq_len, kv_head,
                  first_block, end_block, m, l, acc):
    """Decode attention of one GQA group over logical blocks [first_block, end_block).

    q_group: [group, head_dim] float32, already multiplied by the softmax scale.
    m, l: [group]; acc: [group, head_dim] — initialised by the caller (m=-inf, l=0, acc=0) and
    left unnormalised so a split-K caller can merge partitions.
    """
    group, head_dim = q_group.shape
    block_size = key_cache.shape[2]
    k_tile = np.empty((block_size, head_dim), np.float32)
    v_tile = np.empty((block_size, head_dim), np.float32)
    k_bits = k_tile.view(np.uint32)
    v_bits = v_tile.view(np.uint32)
    scores = np.empty((group, block_size), np.float32)
    for i in range(first_block, end_block):
        block = table_row[i]
        num_tokens = min(block_size, seq_len - i * block_size)
        load_tile(key_cache, block, kv_head, num_tokens, kv_kind, k_tile, k_bits)
        load_tile(value_cache, block, kv_head, num_tokens, kv_kind, v_tile, v_bits)
        for g in range(group):
            score_tile(q_group, g, k_tile, num_tokens, scores, g)
            online_softmax_step(scores, g, num_tokens, v_tile, m, l, acc)
