"""The FA2-class prefill body (tensor-core path): warps split the query rows, not the tokens.

A thread block holds `num_warps x max_rows` query rows (64 at head_dim <= 128: 4 warps x 16
rows; 16 at head_dim 256: 2 warps x 8) of one KV head. The block walks the visible token
range in tiles of `16 * S` tokens (S = num_warps / 2 slices of 16): each tile's K and V are
copied from the paged cache into shared memory once (`cp.async`, warp w stages slice w % S of
K when w < S, else of V) and read by every warp for its own rows, so the cache is read once per
64 query rows instead of once per 16. Tiles are double-buffered: tile t+1's copies are in
flight while tile t is computed, with one `wait_group 1` + block barrier before a tile is read
and one barrier after (its buffer is then free for tile t+2).

Per warp and tile the step is the decode path's (`_tc_attend`: Sᵀ = K·Qᵀ and Oᵀ += Vᵀ·Pᵀ
with `mma.m16n8k16`, online softmax in registers), with one softmax update per tile rather
than per 16-token slice (`make_tile_softmax`): the scores of all S slices first (one
`ldmatrix` of K per k-step for both row tiles, 2-4 independent accumulator chains), then one
row-maximum reduction, one set of rescale factors and one vote per tile, then P·V slice by
slice (variants that split P in two 16-bit parts keep one update per slice: registers).
The causal mask runs only on the diagonal: tiles wholly at or before the block's first
row's last visible position (all but the last one to three of a long prompt) take a loop of
their own with no mask code; the diagonal tiles mask per row, and a tile entirely past the
warp's last visible position is skipped, warp-uniformly. Oᵀ is rescaled only when a warp vote
says some row's factor is not exactly 1 (a row maximum rose): past a prompt's first tiles the
running maxima rarely rise, and multiplying by 1 changes nothing, so skipping it is exact.
Each warp owns its rows to the end, so there is no cross-warp merge: each row is divided by
its sum, staged as float32 in the (then free) tile buffer and stored in 16-byte chunks.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32, int64, uint32

from kernels.cuda._merge import chunk_dims, make_store_chunk
from kernels.cuda._ops import (
    bf16x2_to_f32,
    cp_async_commit,
    cp_async_wait0,
    cp_async_wait1,
    ex2,
    f16x2_to_f32,
    f32x2_to_bf16x2,
    f32x2_to_f16x2,
    ldmatrix_x4,
    mma16816_bf16,
    mma16816_f16,
    movmatrix,
    shfl_xor,
    smem_addr,
)
from kernels.cuda._runtime import SIMULATOR, device_function
from kernels.cuda._spec import KIND_BYTES, TC_STEP_TOKENS, AttentionSpec
from kernels.cuda._stage import make_stager, tile_geometry
from kernels.cuda._table import make_paging
from kernels.cuda._tc_attend import make_tc_load_queries, make_tc_step

NEG_INF = float32(-math.inf)
STEP = TC_STEP_TOKENS


def fa2_geometry(spec: AttentionSpec) -> tuple[int, int, int, int]:
    """(rows per warp, rows per block, slices per tile, shared float32 words) of a variant."""
    rows_w = spec.max_rows
    rows = spec.num_warps * rows_w
    slices = max(1, spec.num_warps // 2)
    _, _, _, tile_bytes = tile_geometry(2 * spec.head_dim, STEP)
    staging = 2 * 2 * slices * tile_bytes  # [buffer][K, V][slice]
    return rows_w, rows, slices, max(staging // 4, rows * spec.head_dim)


@cache
def make_tile_softmax(spec: AttentionSpec, slices: int) -> tuple[Any, Any]:
    """Device functions `(tile_scores, tile_softmax)`: one online-softmax update per warp over
    a whole staged tile (`slices` x 16 tokens) instead of per 16-token slice, so the row
    maxima's shuffles, the rescale factors and the vote are paid once per tile.

    `tile_scores(k_tile, qf, sc)`: Sᵀ of every slice s and row tile rt into
    sc[4(s·R + rt) : +4] (R = row tiles), one `ldmatrix` of K per k-step serving both row
    tiles; `chains` accumulator chains per (slice, row tile), so that at least 4 run
    independently (the second chain's partial sums at +4 * slices * R).
    `tile_softmax(sc, tok0, mask, lims, scale_log2, st, pf, rs)`: the update of _tc_attend's
    `softmax` over all slices at once: Pᵀ B fragments of slice s, row tile rt into
    pf[4(s·R + rt) : +4], factors into rs."""
    head_dim, row_tiles = spec.head_dim, spec.row_tiles
    k_words = head_dim // 8
    k_steps = head_dim // 16
    _, _, stride, tile_bytes = tile_geometry(2 * head_dim, STEP)
    p_split = spec.kv_kind == "bf16" or spec.out_kind == "f32"
    bf16 = spec.kv_kind == "bf16"
    mma = mma16816_bf16 if bf16 else mma16816_f16
    pack = f32x2_to_bf16x2 if bf16 else f32x2_to_f16x2
    unpack = bf16x2_to_f32 if bf16 else f16x2_to_f32
    chains = 1 if slices * row_tiles >= 4 else 2
    second = 4 * slices * row_tiles  # where the second chains' partial sums are

    @device_function
    def slice_scores(k_tile: Any, qf: Any, sc: Any, e0: Any) -> None:
        lane = cuda.laneid
        row = k_tile + int32(((lane & 7) + 8 * ((lane >> 3) & 1)) * stride + 16 * (lane >> 4))
        for ks in range(k_steps):
            a = ldmatrix_x4(row + 32 * ks)
            step = ks // chains
            for rt in range(row_tiles):
                e = e0 + 4 * rt + second * (ks % chains)
                w = rt * k_words + 2 * ks
                sc[e], sc[e + 1], sc[e + 2], sc[e + 3] = mma(
                    a[0], a[1], a[2], a[3], qf[w], qf[w + 1],
                    sc[e] if step > 0 else float32(0.0), sc[e + 1] if step > 0 else float32(0.0),
                    sc[e + 2] if step > 0 else float32(0.0), sc[e + 3] if step > 0 else float32(0.0))
        if chains > 1:
            for rt in range(row_tiles):
                for i in range(4):
                    sc[e0 + 4 * rt + i] += sc[e0 + 4 * rt + second + i]

    @device_function
    def tile_scores(k_tile: Any, qf: Any, sc: Any) -> None:
        slice_scores(k_tile, qf, sc, 0)
        if slices > 1:
            slice_scores(k_tile + tile_bytes, qf, sc, 4 * row_tiles)

    @device_function
    def scale_mask(sc: Any, e: Any, tok: Any, lim_a: Any, lim_b: Any, mask: Any,
                   scale_log2: Any) -> Any:
        """Scale (and mask) one slice's fragments in place; the lane's maxima of rows a, b."""
        x0 = sc[e] * scale_log2
        x1 = sc[e + 1] * scale_log2
        x8 = sc[e + 2] * scale_log2
        x9 = sc[e + 3] * scale_log2
        if mask:
            x0 = x0 if tok <= lim_a else NEG_INF
            x1 = x1 if tok <= lim_b else NEG_INF
            x8 = x8 if tok + 8 <= lim_a else NEG_INF
            x9 = x9 if tok + 8 <= lim_b else NEG_INF
        sc[e], sc[e + 1], sc[e + 2], sc[e + 3] = x0, x1, x8, x9
        return max(x0, x8), max(x1, x9)

    @device_function
    def probs(sc: Any, e: Any, ua: Any, ub: Any, pf: Any, f: Any) -> Any:
        """One slice's probabilities packed into Pᵀ B fragments pf[f:f+4]; their row sums."""
        p0 = ex2(sc[e] - ua)
        p1 = ex2(sc[e + 1] - ub)
        p8 = ex2(sc[e + 2] - ua)
        p9 = ex2(sc[e + 3] - ub)
        hi0 = pack(p0, p1)
        hi8 = pack(p8, p9)
        pf[f] = movmatrix(hi0)
        pf[f + 1] = movmatrix(hi8)
        if p_split:
            h0, h1 = unpack(hi0)
            h8, h9 = unpack(hi8)
            pf[f + 2] = movmatrix(pack(p0 - h0, p1 - h1))
            pf[f + 3] = movmatrix(pack(p8 - h8, p9 - h9))
        return p0 + p8, p1 + p9

    @device_function
    def row_max(x: Any) -> Any:
        x = max(x, shfl_xor(x, 4))
        x = max(x, shfl_xor(x, 8))
        return max(x, shfl_xor(x, 16))

    @device_function
    def tile_softmax(sc: Any, tok0: Any, mask: Any, lims: Any, scale_log2: Any, st: Any,
                     pf: Any, rs: Any) -> None:
        tok = int32(tok0 + (cuda.laneid >> 2))
        for rt in range(row_tiles):
            si = 4 * rt
            e1 = 4 * (row_tiles + rt)  # slice 1's fragments (slices == 2)
            lim_a = lims[2 * rt]
            lim_b = lims[2 * rt + 1]
            ma, mb = scale_mask(sc, 4 * rt, tok, lim_a, lim_b, mask, scale_log2)
            if slices > 1:
                ma1, mb1 = scale_mask(sc, e1, tok + STEP, lim_a, lim_b, mask, scale_log2)
                ma = max(ma, ma1)
                mb = max(mb, mb1)
            ma = max(st[si], row_max(ma))
            mb = max(st[si + 2], row_max(mb))
            ua = ma  # unmasked, every token is visible: the maxima are finite
            ub = mb
            if mask:  # no visible token yet: -inf, and exp2(-inf - 0) = 0
                ua = ma if ma != NEG_INF else float32(0.0)
                ub = mb if mb != NEG_INF else float32(0.0)
            ra = ex2(st[si] - ua)
            rb = ex2(st[si + 2] - ub)
            sa, sb = probs(sc, 4 * rt, ua, ub, pf, 4 * rt)
            if slices > 1:
                sa1, sb1 = probs(sc, e1, ua, ub, pf, 4 * (row_tiles + rt))
                sa += sa1
                sb += sb1
            st[si], st[si + 1] = ma, st[si + 1] * ra + sa
            st[si + 2], st[si + 3] = mb, st[si + 3] * rb + sb
            rs[2 * rt], rs[2 * rt + 1] = ra, rb

    return tile_scores, tile_softmax


@cache
def make_fa2_prefill(spec: AttentionSpec, row_source: Any, row_target: Any) -> Any:
    """Device function `run(k_ptr, v_ptr, tbl_ptr, kv_head, end, scale_log2, *src, *dst)`.

    `row_source(r, *src) -> (query address, real row?, last visible position)` and
    `row_target(r, *dst) -> (address, kind, unused)` map block row r (0 .. rows-1); the block
    attends to positions [0, end), `end` = the block's last visible position + 1.
    """
    head_dim, block_size = spec.head_dim, spec.block_size
    rows_w, rows, slices, buf_floats = fa2_geometry(spec)
    row_tiles = spec.row_tiles
    row_bytes = 2 * head_dim
    head_bytes = block_size * row_bytes
    tile_tokens = STEP * slices
    k_steps = head_dim // 16
    num_acc = 4 * k_steps * row_tiles
    q_words = head_dim // 8 * row_tiles
    state_len = 4 * row_tiles  # [max, sum] of the lane's 2 rows per row tile
    _, _, _, tile_bytes = tile_geometry(row_bytes, STEP)
    paging = make_paging(block_size, spec.num_kv_heads, row_bytes, STEP, slices)
    locate, start, block_div = paging.locate, paging.start, paging.block_div
    per_token = paging.per_token
    stage = make_stager(row_bytes, STEP, paging.half, paging.token_off)
    step, pv, rescale, must_rescale = make_tc_step(spec)
    # One softmax update per tile, except where P is split in two 16-bit parts (bf16 caches,
    # float32 output): there the second slice's 8 more P words spill at 12 warps per SM
    # (36 bytes, bf16 d128), so those variants keep one update per 16-token slice.
    per_tile = not (spec.kv_kind == "bf16" or spec.out_kind == "f32")
    tile_scores, tile_softmax = make_tile_softmax(spec, slices)
    sc_len = 8 * row_tiles * slices  # Sᵀ of every slice and row tile (+ second chains)
    pf_len = 4 * row_tiles * slices if per_tile else 8
    load_queries = make_tc_load_queries(spec)
    chunk = chunk_dims(head_dim)
    chunks_per_row = head_dim // chunk
    items = rows * chunks_per_row
    threads = spec.num_threads
    store_out = make_store_chunk(spec.out_kind, chunk)
    out_bytes = KIND_BYTES[spec.out_kind]
    smem_align = None if SIMULATOR else 16  # cp.async needs 16-byte aligned shared rows

    @device_function
    def stage_tile(tbl_ptr: Any, src: Any, smem: Any, buf_idx: Any, tile0: Any, end: Any,
                   last_blk: Any, win: Any, cur: Any, nxt: Any) -> Any:
        """This warp's share of tile `tile0`: slice w % S of K (w < S) or V into buffer
        buf_idx; rows past `end` zero-filled. Returns the warp's advanced table window."""
        warp = cuda.threadIdx.x >> 5
        s = warp % slices
        tok = int32(tile0 + STEP * s)
        valid = min(int32(end - tok), int32(STEP))
        at = tok if tok < end else tile0  # a slice past the range: any mapped rows, all filled
        win, cur, nxt, lo, hi = locate(tbl_ptr, at, last_blk, win, cur, nxt)
        kv = 0 if warp < slices else 1
        dst = smem + int32(((buf_idx * 2 + kv) * slices + s) * tile_bytes)
        stage(dst, src, at, valid, per_token, lo, hi, cur, nxt, win)
        return win, cur, nxt

    @device_function
    def tile(tbl_ptr: Any, src: Any, smem: Any, t: Any, num_tiles: Any, end: Any, last_blk: Any,
             win: Any, cur: Any, nxt: Any, warp_real: Any, warp_last: Any, lims: Any,
             scale_log2: Any, qf: Any, st: Any, sc: Any, pf: Any, rs: Any, o: Any,
             mask: Any) -> Any:
        """One trip of the block's tile loop: stage tile t+1, wait for tile t, compute it
        (causal mask when `mask`: a constant at each call site). Returns the table window."""
        tile0 = int32(t * tile_tokens)
        if t + 1 < num_tiles:  # the next tile in flight while this one is computed
            win, cur, nxt = stage_tile(tbl_ptr, src, smem, (t + 1) & 1,
                                       int32(tile0 + tile_tokens), end, last_blk, win, cur, nxt)
        cp_async_commit()  # (an empty group after the last tile)
        cp_async_wait1()  # this thread's copies of tile t landed
        # Why: every warp reads the slices all warps copied.
        cuda.syncthreads()
        k_tile = smem + int32((t & 1) * 2 * slices * tile_bytes)
        v_tile = k_tile + int32(slices * tile_bytes)
        # warp-uniform: a tile the warp sees at least part of (always, unmasked)
        if per_tile and warp_real and (not mask or tile0 <= warp_last):
            tile_scores(k_tile, qf, sc)
            tile_softmax(sc, tile0, mask, lims, scale_log2, st, pf, rs)
            if must_rescale(rs):  # warp-uniform; past the first tiles, rarely
                rescale(o, rs)
            pv(v_tile, o, pf, rs, False, 0)
            if slices > 1:
                pv(v_tile + tile_bytes, o, pf, rs, False, 4 * row_tiles)
        if not per_tile and warp_real:  # one update per 16-token slice
            for s in range(slices):
                tok0 = int32(tile0 + STEP * s)
                if not mask or tok0 <= warp_last:  # warp-uniform
                    k_s = k_tile + int32(s * tile_bytes)
                    step(k_s, tok0, mask, lims, end, scale_log2, qf, st, sc, pf, rs)
                    if must_rescale(rs):
                        rescale(o, rs)
                    pv(k_s + int32(slices * tile_bytes), o, pf, rs, False, 0)
        # Why: tile t's buffer is refilled with tile t+2 next trip; all warps must be done.
        cuda.syncthreads()
        return win, cur, nxt

    @device_function
    def run(k_ptr: Any, v_ptr: Any, tbl_ptr: Any, kv_head: Any, end: Any, scale_log2: Any,
            s0: Any, s1: Any, s2: Any, s3: Any, s4: Any, s5: Any,
            t0: Any, t1: Any, t2: Any, t3: Any, t4: Any, t5: Any) -> None:
        buf = cuda.shared.array(buf_floats, float32, alignment=smem_align)
        o = cuda.local.array(num_acc, float32)
        qf = cuda.local.array(q_words, uint32)
        st = cuda.local.array(state_len, float32)
        lims = cuda.local.array(4, int32)
        sc = cuda.local.array(sc_len, float32)
        pf = cuda.local.array(pf_len, uint32)
        rs = cuda.local.array(4, float32)
        vals = cuda.local.array(chunk, float32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.laneid
        r0 = warp * rows_w  # the warp's first block row
        g = lane >> 2
        c2 = 2 * (lane & 3)
        qa, real_a, _lim = row_source(r0 + g, s0, s1, s2, s3, s4, s5)
        qb, real_b, _lim = row_source(r0 + 8 + g, s0, s1, s2, s3, s4, s5)
        load_queries(qa, real_a, qb, real_b, qf)
        # Whether the warp has a real row at all (warp-uniform), and the block's first row's
        # last visible position.
        _q, warp_real, _lim = row_source(r0, s0, s1, s2, s3, s4, s5)
        _q, _real, first_lim = row_source(0, s0, s1, s2, s3, s4, s5)
        first_lim = min(first_lim, end - 1)
        for i in range(num_acc):
            o[i] = float32(0.0)
        for i in range(0, state_len, 2):
            st[i], st[i + 1] = NEG_INF, float32(0.0)
        last_pos = int32(end - 1)
        last_blk = block_div(last_pos)
        src = (k_ptr if warp < slices else v_ptr) + int64(kv_head) * head_bytes
        smem = smem_addr(buf)
        win, cur, nxt = start(tbl_ptr, 0, last_blk)
        num_tiles = (end + tile_tokens - 1) // tile_tokens
        win, cur, nxt = stage_tile(tbl_ptr, src, smem, 0, 0, end, last_blk, win, cur, nxt)
        cp_async_commit()
        # Tiles wholly at or before the block's first row's last visible position need no
        # causal mask for any row (nor the range's end: they lie before it): they run
        # unmasked; the rest (the diagonal: the block's 16-64 query positions span one to
        # three tiles) are masked. Two loops, so the unmasked one carries no mask code.
        num_full = min(num_tiles, (first_lim + 1) // tile_tokens)
        for t in range(num_full):
            win, cur, nxt = tile(tbl_ptr, src, smem, t, num_tiles, end, last_blk, win, cur, nxt,
                                 warp_real, end, lims, scale_log2, qf, st, sc, pf, rs, o, False)
        # The masks' limits, only now (registers: the unmasked loop holds none of them): the
        # last visible position of the lane's softmax rows 2c, 2c+1, 8+2c, 9+2c, and of the
        # warp's last row (rows are in position order: warp-uniform).
        for i in range(4):
            _q, _real, lim = row_source(r0 + c2 + (i & 1) + 8 * (i >> 1), s0, s1, s2, s3, s4, s5)
            lims[i] = min(lim, end - 1)
        _q, _real, warp_last = row_source(r0 + rows_w - 1, s0, s1, s2, s3, s4, s5)
        warp_last = min(warp_last, end - 1)
        for t in range(num_full, num_tiles):
            win, cur, nxt = tile(tbl_ptr, src, smem, t, num_tiles, end, last_blk, win, cur, nxt,
                                 warp_real, warp_last, lims, scale_log2, qf, st, sc, pf, rs, o, True)
        cp_async_wait0()  # (only empty groups remain: no copy outlives the loop)
        # Each row's sum over the warp's 8 token lanes g; then Oᵀ / sum → buf [row, dim].
        for i in range(1, state_len, 2):
            total = st[i]
            total += shfl_xor(total, 4)
            total += shfl_xor(total, 8)
            st[i] = total + shfl_xor(total, 16)
        for rt in range(row_tiles):
            sa = st[4 * rt + 1]
            sb = st[4 * rt + 3]
            f_a = float32(1.0) / sa if sa > float32(0.0) else float32(0.0)
            f_b = float32(1.0) / sb if sb > float32(0.0) else float32(0.0)
            row_a = (r0 + rt * 8 + c2) * head_dim
            row_b = row_a + head_dim
            for j in range(k_steps):
                i = 4 * (k_steps * rt + j)
                buf[row_a + 16 * j + g] = o[i] * f_a
                buf[row_b + 16 * j + g] = o[i + 1] * f_b
                buf[row_a + 16 * j + g + 8] = o[i + 2] * f_a
                buf[row_b + 16 * j + g + 8] = o[i + 3] * f_b
        # Why: a row's chunks are stored by other threads than the lanes that staged them.
        cuda.syncthreads()
        for item in range(cuda.threadIdx.x, items, threads):
            r = item // chunks_per_row
            d0 = (item - r * chunks_per_row) * chunk
            addr, kind, _unused = row_target(r, t0, t1, t2, t3, t4, t5)
            if kind != 0:
                for i in range(chunk):
                    vals[i] = buf[r * head_dim + d0 + i]
                store_out(addr + d0 * out_bytes, vals)

    return run
