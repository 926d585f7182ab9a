"""Numba helpers shared by the CPU attention kernels: tile widening and one online-softmax step.

The attention kernels walk a sequence's block table one block at a time. For each block they
widen the K and V tiles of one KV head to float32 scratch tiles, score the K tile against every
query head of the GQA group, and fold the scores into a running max / running sum /
unnormalised accumulator (online softmax). Reading each K/V byte once per KV head — not once
per query head — is what keeps the kernels memory-bound rather than compute-bound, as on the
GPU. Inner loops run over contiguous 1-D rows so LLVM vectorises them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels.cpu._cache import njit_cached
from kernels.cpu._host import KIND_BF16, KIND_F16

# Fast-math without `nnan`/`ninf`: the running max starts at -inf and a NaN in a corrupted
# cache must reach the output instead of being optimised into garbage.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


@intrinsic
def half_bits_to_f32(typingctx, bits):
    """IEEE half (as uint16 bits) → float32, exactly (subnormals, Inf and NaN included).

    Numba's CPU target has no float16 type, but LLVM does: a bitcast to `half` and an `fpext`
    compile to the hardware conversion (x86 F16C `vcvtph2ps`, AArch64 `fcvt`), and vectorise —
    about 4x faster than converting with integer bit tricks.
    """
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@njit_cached(fastmath=FASTMATH)
def load_tile(cache, block, head, num_tokens, kv_kind, tile_f32, tile_u32):
    """Widen `cache[block, head, :num_tokens, :]` to float32 into `tile_f32`.

    `cache` is the uint16 view of a `[num_blocks, num_kv_heads, block_size, head_dim]` cache
    (fp32: two little-endian halves per element, so its last dim is 2 * head_dim);
    `tile_u32` aliases `tile_f32` (bf16 and fp32 are assembled as bits).
    """
    head_dim = tile_f32.shape[1]
    for t in range(num_tokens):
        src = cache[block, head, t]
        if kv_kind == KIND_F16:
            dst = tile_f32[t]
            for d in range(head_dim):
                dst[d] = half_bits_to_f32(src[d])
        elif kv_kind == KIND_BF16:
            bits = tile_u32[t]
            for d in range(head_dim):
                bits[d] = np.uint32(src[d]) << 16  # bf16 is the top half of a float32
        else:
            bits = tile_u32[t]
            for d in range(head_dim):
                bits[d] = np.uint32(src[2 * d]) | (np.uint32(src[2 * d + 1]) << 16)


@njit_cached(fastmath=FASTMATH)
def score_tile(q_rows, row, k_tile, num_tokens, scores):
    """scores[row, t] = q_rows[row] · k_tile[t] for t < num_tokens (q_rows pre-scaled)."""
    q = q_rows[row]
    out = scores[row]
    head_dim = q.shape[0]
    for t in range(num_tokens):
        k = k_tile[t]
        dot = np.float32(0.0)
        for d in range(head_dim):
            dot += q[d] * k[d]
        out[t] = dot


@njit_cached(fastmath=FASTMATH)
def online_softmax_step(scores, row, num_tokens, v_tile, m, l, acc):
    """Fold one block's logits `scores[row, :num_tokens]` into the running state of `row`.

    `m[row]` is the running max, `l[row]` the running sum of exp(logit - m) and `acc[row]` the
    running sum of exp(logit - m) * v. Rescaling by exp(m_old - m_new) keeps every exponent
    ≤ 0, so nothing overflows however large the logits are; m starts at -inf, and the first
    block always has a visible token, so exp(-inf) = 0 wipes the empty initial state.
    Overwrites `scores[row, :num_tokens]` with the probabilities.
    """
    p = scores[row]
    block_max = p[0]
    for t in range(1, num_tokens):
        block_max = max(block_max, p[t])
    m_old = m[row]
    m_new = max(block_max, m_old)
    alpha = np.float32(np.exp(m_old - m_new))
    total = np.float32(0.0)
    for t in range(num_tokens):
        e = np.float32(np.exp(p[t] - m_new))
        p[t] = e
        total += e
    a = acc[row]
    head_dim = a.shape[0]
    if alpha != 1.0:
        for d in range(head_dim):
            a[d] *= alpha
    for t in range(num_tokens):
        weight = p[t]
        v = v_tile[t]
        for d in range(head_dim):
            a[d] += weight * v[d]
    l[row] = l[row] * alpha + total
    m[row] = m_new


@njit_cached(fastmath=FASTMATH)
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
            score_tile(q_group, g, k_tile, num_tokens, scores)
            online_softmax_step(scores, g, num_tokens, v_tile, m, l, acc)
