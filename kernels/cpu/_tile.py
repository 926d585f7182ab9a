"""Numba helpers shared by the CPU attention kernels: tile widening and one online-softmax step.

The attention kernels walk a sequence's block table one block at a time. For each block they
take the K and V tiles of one KV head as float32 (`kv_tile`: an fp32 cache's own memory, fp16 and
bf16 widened into scratch tiles), score the K tile against every
query head of the GQA group, and fold the scores into a running max / running sum /
unnormalised accumulator (online softmax). Reading each K/V byte once per KV head — not once
per query head — is what keeps the kernels memory-bound rather than compute-bound, as on the
GPU. Inner loops run over contiguous 1-D rows so LLVM vectorises them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu._cache import njit_cached
from kernels.cpu._host import KIND_BF16, KIND_F16, KIND_F32

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


@intrinsic
def _pow2_of_shifted(typingctx, shifted):
    """2**n as float32, from `shifted` = n + 1.5 * 2**23 (float32, n an integer in [-126, 127]).

    Adding 1.5 * 2**23 to a float32 of magnitude below 2**22 rounds it to an integer and leaves
    that integer in the low mantissa bits, so n is the bit pattern minus the shifter's; 2**n is
    then the exponent field n + 127 alone.
    """
    if shifted != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        n = builder.sub(builder.bitcast(args[0], i32), ir.Constant(i32, 0x4B400000))
        exponent = builder.shl(builder.add(n, ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(exponent, ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def prefetch_line(typingctx, array, index):
    """Ask the CPU to bring the cache line holding `array.flat[index]` (a 1-D array) towards
    L1 (LLVM's `llvm.prefetch`: read, high temporal locality, data cache). A hint: no fault,
    no effect on results.

    Why: a sequence's blocks sit at scattered pool ids, so each block is a separate 4 KB page
    (16 tokens x 64 dims of float32) that the hardware prefetchers, which stay within a page,
    never start on before the first load misses. Naming the next block's lines while the
    current one is computed overlaps its DRAM latency (measured on 30 layers of DRAM-resident
    K/V: 32 sequences x 300 tokens 42 -> 34 ms, 8 x 1,700 tokens 53 -> 51 ms).
    """
    if not isinstance(array, types.Array) or array.ndim != 1 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, array_type, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


_SHIFTER = np.float32(1.5 * 2**23)


# No `reassoc`: the two-constant range reduction below must not be folded into one product.
@njit_cached(fastmath={"contract"})
def exp_f32(x):
    """exp(x) in float32 with a relative error below 2**-23 (about one ulp) for x in [-87, 88]
    (0 below, inf above; NaN stays NaN), branch-free so a loop over it vectorises.

    Softmax spends one exp per (query head, key) pair: as a call to libm's scalar `expf` (Numba
    has no vector math library here) that was most of a decode kernel's time (~15 ns each vs
    ~0.5 here, measured in a loop). Cody-Waite reduction x = n ln2 + r with ln2 split in two
    constants, then a degree-7 polynomial for exp(r) on |r| <= ln2 / 2 (the Cephes expf
    coefficients), scaled by 2**n.
    """
    xc = min(max(x, np.float32(-87.0)), np.float32(88.0))
    shifted = xc * np.float32(1.44269504088896341) + _SHIFTER
    n = shifted - _SHIFTER
    r = xc - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r + np.float32(1.0)) * _pow2_of_shifted(shifted)
    if x < np.float32(-87.0):
        y = np.float32(0.0)
    if x > np.float32(88.0):
        y = np.float32(np.inf)
    if x != x:
        y = x
    return y


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
def kv_tile(cache, block, head, num_tokens, kv_kind, tile_f32, tile_u32):
    """`cache[block, head]` as a float32 `[block_size, head_dim]` tile, valid for its first
    `num_tokens` rows.

    An fp32 cache already holds float32 rows (its uint16 view pairs the halves of each value),
    so the tile is that memory itself, viewed as float32: no copy and no bit assembly. fp16 and
    bf16 are widened into `tile_f32` (`load_tile`), which is returned.
    """
    if kv_kind == KIND_F32:
        return cache[block, head].view(np.float32)
    load_tile(cache, block, head, num_tokens, kv_kind, tile_f32, tile_u32)
    return tile_f32


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
    alpha = exp_f32(m_old - m_new)
    total = np.float32(0.0)
    for t in range(num_tokens):
        e = exp_f32(p[t] - m_new)
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
    # the next block's K and V lines of this head, fetched while this block is computed
    head_stride = block_size * key_cache.shape[3]           # uint16 elements of one head's block
    block_stride = key_cache.shape[1] * head_stride
    keys_flat = key_cache.reshape(-1)
    values_flat = value_cache.reshape(-1)
    for i in range(first_block, end_block):
        if i + 1 < end_block:
            base = table_row[i + 1] * block_stride + kv_head * head_stride
            for offset in range(0, head_stride, 32):          # 32 uint16: one 64-byte line
                prefetch_line(keys_flat, base + offset)
                prefetch_line(values_flat, base + offset)
        block = table_row[i]
        num_tokens = min(block_size, seq_len - i * block_size)
        keys = kv_tile(key_cache, block, kv_head, num_tokens, kv_kind, k_tile, k_bits)
        values = kv_tile(value_cache, block, kv_head, num_tokens, kv_kind, v_tile, v_bits)
        for g in range(group):
            score_tile(q_group, g, keys, num_tokens, scores)
            online_softmax_step(scores, g, num_tokens, values, m, l, acc)
