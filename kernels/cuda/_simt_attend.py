"""Float32-FMA attention over a token range, one warp per token stream (any cache type).

The fallback of `_tc_attend.py` for what the tensor cores cannot take exactly: float32 caches,
queries of another type than the cache, head dims that are not a multiple of 16. Same frame:
each warp walks every `num_warps`-th step of the range with its own softmax state (merged at the
end), staging the step's K and V tiles in its shared memory with `cp.async`, one step ahead.

Lane l owns `vec` consecutive dims [l*vec, (l+1)*vec) of every row (`spec.simt_vec`) and keeps
the R query rows' slices (R*vec <= 32 registers) and accumulators there. A step is
T = 32 / R_pad tokens (R_pad: R rounded up to a power of two, at least 4 — at most 8 tokens),
so the step's (token, row) dot products are exactly 32: each lane computes its partial sums of
all 32, and one transposing
reduction (31 shuffles: at each level a lane keeps half of its sums and sends the other half)
leaves lane p with the full dot product of pair p = (token p // R_pad, row p % R_pad). Softmax
then runs on lanes: a row's max is a reduction over the lanes of that row. For P·V, each lane
broadcasts its probability to the others (one shuffle per pair), and every lane accumulates
its own dims of every row.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32, int64

from kernels.cuda._merge import make_row_stats
from kernels.cuda._ops import (
    bf16x2_to_f32,
    bits_f32,
    cp_async_commit,
    cp_async_wait0,
    cp_async_wait1,
    ex2,
    f16x2_to_f32,
    ld_u32,
    ld_v2,
    ld_v4,
    lds_u32,
    lds_v2,
    lds_v4,
    shfl_idx,
    shfl_xor,
    smem_addr,
    syncwarp,
)
from kernels.cuda._runtime import device_function
from kernels.cuda._spec import KIND_BYTES, WARP, AttentionSpec, simt_vec
from kernels.cuda._stage import make_stager, tile_geometry
from kernels.cuda._table import make_paging

NEG_INF = float32(-math.inf)


def padded_rows(spec: AttentionSpec) -> int:
    """Rows of a step's (token, row) pairs: R rounded up to a power of two, at least 4."""
    return WARP // spec.simt_step


def step_tokens(spec: AttentionSpec) -> int:
    """Tokens per warp step: (token, row) pairs fill the 32 lanes exactly."""
    return spec.simt_step


def simt_sizes(spec: AttentionSpec) -> tuple[int, int, int]:
    """(accumulator floats, query floats per lane, staging bytes of the block)."""
    vec = simt_vec(spec.head_dim, spec.kv_kind)
    tile = tile_geometry(spec.head_dim * KIND_BYTES[spec.kv_kind], step_tokens(spec))[3]
    return spec.rows * vec, spec.rows * vec, spec.num_warps * 2 * tile


@cache
def make_load_elems(kind: str, vec: int) -> Any:
    """Device function: `vec` elements of `kind` at a 4-byte aligned address → float32, from
    shared (`shared=True`) or global memory."""
    esz = KIND_BYTES[kind]
    nbytes = vec * esz
    words = nbytes // 4

    @device_function
    def word(addr: Any, i: Any, shared: Any) -> Any:
        """32-bit word i, read with the widest load the slice allows."""
        if shared:
            if words % 4 == 0:
                return lds_v4(addr + 16 * (i // 4))[i % 4]
            if words % 2 == 0:
                return lds_v2(addr + 8 * (i // 2))[i % 2]
            return lds_u32(addr + 4 * i)
        if words % 4 == 0:
            return ld_v4(addr + 16 * (i // 4))[i % 4]
        if words % 2 == 0:
            return ld_v2(addr + 8 * (i // 2))[i % 2]
        return ld_u32(addr + 4 * i)

    @device_function
    def load(addr: Any, out: Any, base: Any, shared: Any) -> None:
        for i in range(words):
            w = word(addr, i, shared)
            if esz == 4:
                out[base + i] = bits_f32(w)
            else:
                lo, hi = bf16x2_to_f32(w) if kind == "bf16" else f16x2_to_f32(w)
                out[base + 2 * i] = lo
                out[base + 2 * i + 1] = hi

    return load


@cache
def make_simt_attend(spec: AttentionSpec) -> Any:
    """Device function `attend(...)` of one variant; see the module docstring."""
    head_dim, block_size, rows = spec.head_dim, spec.block_size, spec.rows
    num_warps = spec.num_warps
    vec = simt_vec(head_dim, spec.kv_kind)
    active = head_dim // vec  # lanes that own dims
    r_pad = padded_rows(spec)
    step = step_tokens(spec)
    esz = KIND_BYTES[spec.kv_kind]
    row_bytes = head_dim * esz
    head_bytes = block_size * row_bytes
    _, _, stride, tile_bytes = tile_geometry(row_bytes, step)
    causal = spec.mode == "prefill"
    load_kv = make_load_elems(spec.kv_kind, vec)
    paging = make_paging(block_size, spec.num_kv_heads, row_bytes, step, num_warps)
    block_div, locate, offsets, start = paging.block_div, paging.locate, paging.offsets, paging.start
    per_token = paging.per_token
    stage = make_stager(row_bytes, step, paging.half, paging.token_off)

    @device_function
    def reduce_pairs(part: Any) -> Any:
        """Transposing reduction: lane l returns the warp-wide sum of everyone's part[l]."""
        lane = cuda.laneid
        for level in range(5):
            m = WARP >> (level + 1)
            upper = lane & m
            for i in range(m):
                send = part[i] if upper else part[i + m]
                keep = part[i + m] if upper else part[i]
                part[i] = keep + shfl_xor(send, m)
        return part[0]

    @device_function
    def scores(k_tile: Any, qf: Any, part: Any, kv: Any) -> Any:
        lane = cuda.laneid
        for t in range(step):
            for i in range(vec):
                kv[i] = float32(0.0)
            if lane < active:
                load_kv(k_tile + int32(t * stride + lane * vec * esz), kv, 0, True)
            for r in range(r_pad):
                acc = float32(0.0)
                if r < rows:
                    for i in range(vec):
                        acc += qf[r * vec + i] * kv[i]
                part[t * r_pad + r] = acc
        return reduce_pairs(part)

    @device_function
    def row_reduce_max(x: Any) -> Any:
        for level in range(5):  # lanes of one row differ in the bits above r_pad
            m = WARP >> (level + 1)
            if m >= r_pad:
                x = max(x, shfl_xor(x, m))
        return x

    @device_function
    def row_reduce_sum(x: Any) -> Any:
        for level in range(5):
            m = WARP >> (level + 1)
            if m >= r_pad:
                x += shfl_xor(x, m)
        return x

    @device_function
    def accumulate(v_tile: Any, o: Any, p: Any, alpha: Any, kv: Any) -> None:
        lane = cuda.laneid
        for r in range(rows):  # lane r holds pair (token 0, row r): row r's factor
            a = shfl_idx(alpha, r)
            for i in range(vec):
                o[r * vec + i] *= a
        for t in range(step):
            for i in range(vec):
                kv[i] = float32(0.0)
            if lane < active:
                load_kv(v_tile + int32(t * stride + lane * vec * esz), kv, 0, True)
            for r in range(rows):
                w = shfl_idx(p, t * r_pad + r)
                for i in range(vec):
                    o[r * vec + i] += w * kv[i]

    @device_function
    def attend(k_ptr: Any, v_ptr: Any, tbl_ptr: Any, kv_head: Any, begin: Any, end: Any,
               lim: Any, scale_log2: Any, qf: Any, o: Any, st: Any, buf: Any) -> None:
        """This warp's steps of the rows' attention to tokens [begin, end) of one sequence.

        qf: this lane's dims of every row's query (float32); lim: last visible position of
        the lane's row (lane % R_pad). Leaves the unnormalised accumulators in `o` and the
        lane's row [max, sum] (log2 domain, summed over the warp) in st[0:2]. `begin` is a
        multiple of the step.
        """
        warp = cuda.threadIdx.x >> 5
        for i in range(rows * vec):
            o[i] = float32(0.0)
        st[0], st[1] = NEG_INF, float32(0.0)
        end = int32(end)
        last_blk = block_div(int32(end - 1))
        win, cur, nxt = start(tbl_ptr, begin, last_blk)
        k_src = k_ptr + int64(kv_head) * head_bytes
        v_src = v_ptr + int64(kv_head) * head_bytes
        smem = smem_addr(buf) + int32(warp * 2 * tile_bytes)  # this warp's K tile, then V
        v_tile = smem + tile_bytes
        part = cuda.local.array(WARP, float32)
        kv = cuda.local.array(vec, float32)
        tok0 = int32(begin + step * warp)
        if tok0 < end:  # prologue: the first step's tiles, one group each
            win, cur, nxt, lo, hi = locate(tbl_ptr, tok0, last_blk, win, cur, nxt)
            valid = min(int32(end - tok0), step)
            stage(smem, k_src, tok0, valid, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()
            stage(v_tile, v_src, tok0, valid, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()
        while tok0 < end:  # warp-uniform trip count
            nt = int32(tok0 + step * num_warps)
            valid = min(int32(end - tok0), step)
            cp_async_wait1()  # this step's K landed
            syncwarp()  # every lane's K copies visible before any lane reads the tile
            t_mine = cuda.laneid // r_pad
            x = scores(smem, qf, part, kv) * scale_log2
            syncwarp()  # K tile read by all lanes: free for the next step's copies
            if nt < end:
                win, cur, nxt, lo, hi = locate(tbl_ptr, nt, last_blk, win, cur, nxt)
                stage(smem, k_src, nt, min(int32(end - nt), step), per_token, lo, hi, cur, nxt,
                      win)
            cp_async_commit()
            if (causal or valid < step) and (t_mine >= valid or tok0 + t_mine > lim):
                x = NEG_INF
            m_new = max(st[0], row_reduce_max(x))
            m_use = m_new if m_new != NEG_INF else float32(0.0)  # no visible token yet
            alpha = ex2(st[0] - m_use)
            p = ex2(x - m_use)
            st[0] = m_new
            st[1] = st[1] * alpha + p
            cp_async_wait1()  # this step's V landed
            syncwarp()  # every lane's V copies visible before any lane reads the tile
            accumulate(v_tile, o, p, alpha, kv)
            syncwarp()  # V tile read: free
            if nt < end:
                lo, hi = offsets(nt, win, cur, nxt)
                stage(v_tile, v_src, nt, min(int32(end - nt), step), per_token, lo, hi, cur, nxt,
                      win)
            cp_async_commit()
            tok0 = nt
        cp_async_wait0()  # no copy may outlive the loop: the merge reuses the buffer
        st[1] = row_reduce_sum(st[1])

    return attend


@cache
def make_simt_load_queries(spec: AttentionSpec, row_source: Any) -> Any:
    """Device function `load(qf, *src) -> lim`: the lane's dims of every row's query as
    float32 (0 for rows that are not real), and the last visible position of its own row."""
    rows, vec = spec.rows, simt_vec(spec.head_dim, spec.kv_kind)
    active = spec.head_dim // vec
    q_bytes = KIND_BYTES[spec.q_kind]
    r_pad = padded_rows(spec)
    load_q = make_load_elems(spec.q_kind, vec)

    @device_function
    def load_queries(qf: Any, s0: Any, s1: Any, s2: Any, s3: Any, s4: Any, s5: Any) -> Any:
        lane = cuda.laneid
        for i in range(rows * vec):
            qf[i] = float32(0.0)
        for r in range(rows):
            addr, real, _lim = row_source(r, s0, s1, s2, s3, s4, s5)
            if real and lane < active:
                load_q(addr + lane * vec * q_bytes, qf, r * vec, False)
        _addr, _real, lim = row_source(min(lane % r_pad, rows - 1), s0, s1, s2, s3, s4, s5)
        return lim

    return load_queries


@cache
def make_simt_stage(spec: AttentionSpec) -> Any:
    """`publish` / `stage` of the cross-warp merge (`_merge.py`) for lane-owned dims."""
    head_dim, rows, vec = spec.head_dim, spec.rows, simt_vec(spec.head_dim, spec.kv_kind)
    active = head_dim // vec
    _, row_factor = make_row_stats(spec.num_warps)

    @device_function
    def publish(st: Any, ms: Any, ls: Any) -> None:
        lane = cuda.laneid
        if lane < rows:  # lane r holds pair (token 0, row r)
            warp = cuda.threadIdx.x >> 5
            ms[warp, lane] = st[0]
            ls[warp, lane] = st[1]

    @device_function
    def stage(o: Any, rt: Any, os: Any, ms: Any, ls: Any, normalize: Any) -> None:
        lane = cuda.laneid
        warp = cuda.threadIdx.x >> 5
        for r in range(rows):
            if r // 8 == rt:
                f = row_factor(ms, ls, warp, r, normalize)
                if lane < active:
                    for i in range(vec):
                        os[(warp * 8 + r % 8) * head_dim + lane * vec + i] = o[r * vec + i] * f

    return publish, stage
