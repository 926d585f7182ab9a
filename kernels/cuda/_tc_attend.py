"""Tensor-core attention over a token range, one warp per token stream (fp16 / bf16 K/V).

Each warp of a thread block walks every `num_warps`-th step of 16 tokens of the range and keeps
its own online-softmax state: the main loop has no block barrier, and the kernels merge the
warps' states once at the end (`_merge.py`). A warp stages each step's K and V tiles in its own
shared memory with `cp.async` (`_stage.py`), the next step's tiles in flight while the current
one is computed. Per step, for up to 16 query rows (GQA heads x query tokens) of one KV head,
with lane = (g, c) = (lane >> 2, lane & 3):

1. Sᵀ = K·Qᵀ with `mma.m16n8k16` (A = K: 16 tokens x 16 dims, by `ldmatrix`; B = Qᵀ: 8 query
   rows per n-tile, held in registers for the whole range).
2. Softmax in the log2 domain on the C fragments: lane (g, c) holds rows 2c and 2c+1 for tokens
   g and g+8; a row's max is three xor-shuffles across g. Masked tokens are -inf, and
   exp2(-inf) = 0. The rows' rescale factors stay in the lane: the Oᵀ accumulator's columns
   are the same rows 2c, 2c+1.
3. Oᵀ += Vᵀ·Pᵀ with `mma.m16n8k16` (A = Vᵀ: 16 dims x 16 tokens, by `ldmatrix.trans`; B = Pᵀ:
   the probabilities packed to 16 bits and transposed per 8x8 tile by `movmatrix`). Oᵀ
   (head_dim x 8 rows) costs D/4 float32 registers per 8 rows.

bf16 probabilities keep 8 bits, and float32 outputs want more than fp16's 11: there P is split
into hi + lo 16-bit parts and multiplied twice (the tensor cores are far from busy).
The block table is read through a per-warp window (`_table.py`). Rows past the range are
zero-filled, not read, and masked out of the softmax (0·V = 0, whatever a slot past the end
holds, even NaN).
Token and offset arithmetic is 32-bit; only a block's byte offset is 64-bit.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32, int64, uint32

from kernels.cuda._merge import make_row_stats
from kernels.cuda._ops import (
    any_sync,
    bf16x2_to_f32,
    cp_async_commit,
    cp_async_wait0,
    cp_async_wait1,
    ex2,
    f16x2_to_f32,
    f32x2_to_bf16x2,
    f32x2_to_f16x2,
    ld_u32,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma16816_bf16,
    mma16816_f16,
    movmatrix,
    shfl_xor,
    smem_addr,
    syncwarp,
)
from kernels.cuda._runtime import device_function
from kernels.cuda._spec import TC_STEP_TOKENS, AttentionSpec
from kernels.cuda._stage import make_stager, tile_geometry
from kernels.cuda._table import make_paging

NEG_INF = float32(-math.inf)
STEP = TC_STEP_TOKENS


@cache
def make_tc_step(spec: AttentionSpec) -> tuple[Any, Any, Any, Any]:
    """Device functions `(scores_softmax, pv, rescale, must_rescale)`: one 16-token step of a
    warp's rows on K and V tiles already in shared memory (steps 1-3 of the module docstring).
    Shared by the per-warp token streams below (Oᵀ rescaled inside `pv`) and the FA2-class
    prefill (`_fa2_prefill.py`: `rescale` only when `must_rescale`, a warp vote)."""
    head_dim, row_tiles = spec.head_dim, spec.row_tiles
    row_bytes = 2 * head_dim
    k_words = head_dim // 8  # query words per row per lane
    k_steps = head_dim // 16  # k-steps of Sᵀ = K·Qᵀ, and m-tiles of Oᵀ
    _, _, stride, _ = tile_geometry(row_bytes, STEP)
    p_split = spec.kv_kind == "bf16" or spec.out_kind == "f32"
    causal = spec.mode == "prefill"  # rows see different prefixes: mask every step
    bf16 = spec.kv_kind == "bf16"
    mma = mma16816_bf16 if bf16 else mma16816_f16
    pack = f32x2_to_bf16x2 if bf16 else f32x2_to_f16x2
    unpack = bf16x2_to_f32 if bf16 else f16x2_to_f32

    @device_function
    def scores(k_tile: Any, qf: Any, rt: Any, s: Any) -> None:
        """Sᵀ (16 tokens x query rows 8rt..8rt+7) into s[0:4]."""
        lane = cuda.laneid
        # ldmatrix rows: lanes 0-7 / 8-15 tokens 0-7 / 8-15 of dims 16s..16s+7; 16-31: +8 dims
        row = k_tile + int32(((lane & 7) + 8 * ((lane >> 3) & 1)) * stride + 16 * (lane >> 4))
        for ks in range(k_steps):  # two accumulator chains: half the dependent mma latency
            a = ldmatrix_x4(row + 32 * ks)
            e = 4 * (ks & 1)
            s[e], s[e + 1], s[e + 2], s[e + 3] = mma(
                a[0], a[1], a[2], a[3], qf[rt * k_words + 2 * ks], qf[rt * k_words + 2 * ks + 1],
                s[e] if ks > 1 else float32(0.0), s[e + 1] if ks > 1 else float32(0.0),
                s[e + 2] if ks > 1 else float32(0.0), s[e + 3] if ks > 1 else float32(0.0))
        if k_steps > 1:
            for i in range(4):
                s[i] += s[4 + i]

    @device_function
    def row_max(x0: Any, x1: Any) -> Any:
        mx = max(x0, x1)
        mx = max(mx, shfl_xor(mx, 4))
        mx = max(mx, shfl_xor(mx, 8))
        return max(mx, shfl_xor(mx, 16))

    @device_function
    def softmax(s: Any, tok: Any, lim_a: Any, lim_b: Any, mask: Any, scale_log2: Any, st: Any,
                rt: Any, pf: Any, rs: Any) -> None:
        """Online-softmax update of rows 8rt+2c (state st[4rt], st[4rt+1]) and 8rt+2c+1
        (st[4rt+2], st[4rt+3]) from Sᵀ fragments s (tokens g | g+8): Pᵀ B fragments into
        pf[4rt:4rt+4], the rows' rescale factors into rs[2rt], rs[2rt+1]."""
        si = 4 * rt
        x0 = s[0] * scale_log2
        x1 = s[1] * scale_log2
        x8 = s[2] * scale_log2
        x9 = s[3] * scale_log2
        if mask:
            x0 = x0 if tok <= lim_a else NEG_INF
            x1 = x1 if tok <= lim_b else NEG_INF
            x8 = x8 if tok + 8 <= lim_a else NEG_INF
            x9 = x9 if tok + 8 <= lim_b else NEG_INF
        ma = max(st[si], row_max(x0, x8))
        mb = max(st[si + 2], row_max(x1, x9))
        ua = ma  # unmasked, every token is visible: the maxima are finite
        ub = mb
        if mask:  # no visible token yet: -inf, and exp2(-inf - 0) = 0
            ua = ma if ma != NEG_INF else float32(0.0)
            ub = mb if mb != NEG_INF else float32(0.0)
        ra = ex2(st[si] - ua)
        rb = ex2(st[si + 2] - ub)
        p0 = ex2(x0 - ua)
        p8 = ex2(x8 - ua)
        p1 = ex2(x1 - ub)
        p9 = ex2(x9 - ub)
        st[si], st[si + 1] = ma, st[si + 1] * ra + (p0 + p8)
        st[si + 2], st[si + 3] = mb, st[si + 3] * rb + (p1 + p9)
        rs[2 * rt], rs[2 * rt + 1] = ra, rb
        hi0 = pack(p0, p1)  # row g of the 8x8 tile Pᵀ[tokens 0-7, rows]: movmatrix → P[rows]
        hi8 = pack(p8, p9)
        pf[si] = movmatrix(hi0)
        pf[si + 1] = movmatrix(hi8)
        if p_split:
            h0, h1 = unpack(hi0)
            h8, h9 = unpack(hi8)
            pf[si + 2] = movmatrix(pack(p0 - h0, p1 - h1))
            pf[si + 3] = movmatrix(pack(p8 - h8, p9 - h9))

    @device_function
    def pv(v_tile: Any, o: Any, pf: Any, rs: Any, scaled: Any, p0: Any) -> None:
        """Oᵀ[:, rows 2c, 2c+1 of every row tile] = rescaled Oᵀ + Vᵀ·Pᵀ (`scaled`, a constant at
        each call site: the rows' factors rs applied here, on the MMA's C input; else Oᵀ is
        taken as it is, `rescale` applied before when needed). The Pᵀ fragments are
        pf[p0 + 4rt : p0 + 4rt + 4] (p0 a constant: the FA2 prefill keeps two slices')."""
        lane = cuda.laneid
        # ldmatrix.trans rows: lanes 0-7 tokens 0-7 dims 16j..; 8-15: dims +8; 16-31: tokens +8
        row = v_tile + int32(((lane & 7) + 8 * (lane >> 4)) * stride + 16 * ((lane >> 3) & 1))
        for j in range(k_steps):
            a = ldmatrix_x4_trans(row + 32 * j)
            for rt in range(row_tiles):
                i = 4 * (k_steps * rt + j)
                ra = rs[2 * rt]
                rb = rs[2 * rt + 1]
                if not scaled:
                    ra = rb = float32(1.0)  # x * 1.0 folds away
                f = p0 + 4 * rt
                c0, c1, c2, c3 = mma(a[0], a[1], a[2], a[3], pf[f], pf[f + 1],
                                     o[i] * ra, o[i + 1] * rb, o[i + 2] * ra, o[i + 3] * rb)
                if p_split:
                    c0, c1, c2, c3 = mma(a[0], a[1], a[2], a[3], pf[f + 2], pf[f + 3],
                                         c0, c1, c2, c3)
                o[i], o[i + 1], o[i + 2], o[i + 3] = c0, c1, c2, c3

    @device_function
    def rescale(o: Any, rs: Any) -> None:
        """Oᵀ of every row tile times its rows' factors rs (what `pv(..., True)` does inline)."""
        for rt in range(row_tiles):
            ra = rs[2 * rt]
            rb = rs[2 * rt + 1]
            for j in range(k_steps):
                i = 4 * (k_steps * rt + j)
                o[i] *= ra
                o[i + 1] *= rb
                o[i + 2] *= ra
                o[i + 3] *= rb

    @device_function
    def must_rescale(rs: Any) -> Any:
        """Whether any lane's row factor differs from 1 (a row maximum rose, or a row saw no
        token yet: factor 0 on an Oᵀ of zeros), warp-uniformly; when not, `rescale` would
        multiply by exactly 1 (ex2(+0) = +1 in PTX's table and here) and can be skipped."""
        need = False
        for i in range(2 * row_tiles):
            need = need or rs[i] != float32(1.0)
        return any_sync(need)

    @device_function
    def scores_softmax(k_tile: Any, tok0: Any, mask: Any, lims: Any, last_pos: Any,
                       scale_log2: Any, qf: Any, st: Any, s: Any, pf: Any, rs: Any) -> None:
        """Scores and softmax of every row tile (the step's K tile must have landed)."""
        tok = int32(tok0 + (cuda.laneid >> 2))
        for rt in range(row_tiles):
            scores(k_tile, qf, rt, s)
            if causal:
                softmax(s, tok, lims[2 * rt], lims[2 * rt + 1], mask, scale_log2, st, rt, pf, rs)
            else:  # every row sees the whole range: the limit is its end
                softmax(s, tok, last_pos, last_pos, mask, scale_log2, st, rt, pf, rs)

    return scores_softmax, pv, rescale, must_rescale


@cache
def make_tc_attend(spec: AttentionSpec) -> Any:
    """Device function `attend(...)` of one variant; see the module docstring."""
    head_dim, block_size, row_tiles = spec.head_dim, spec.block_size, spec.row_tiles
    num_warps = spec.num_warps
    row_bytes = 2 * head_dim
    head_bytes = block_size * row_bytes
    num_acc = 4 * (head_dim // 16) * row_tiles
    _, _, _, tile_bytes = tile_geometry(row_bytes, STEP)
    causal = spec.mode == "prefill"  # rows see different prefixes: mask every step
    paging = make_paging(block_size, spec.num_kv_heads, row_bytes, STEP, num_warps)
    block_div, locate, offsets, start = paging.block_div, paging.locate, paging.offsets, paging.start
    per_token = paging.per_token
    stage = make_stager(row_bytes, STEP, paging.half, paging.token_off)
    scores_softmax, pv, _rescale, _must = make_tc_step(spec)

    @device_function
    def attend(k_ptr: Any, v_ptr: Any, tbl_ptr: Any, kv_head: Any, begin: Any, end: Any,
               lims: Any, scale_log2: Any, qf: Any, o: Any, st: Any, buf: Any) -> None:
        """This warp's steps of the rows' attention to tokens [begin, end) of one sequence.

        qf: query B fragments (k_words words of row g, then of row 8+g); lims: last visible
        position of rows 2c, 2c+1, 8+2c, 9+2c (each <= end - 1); buf: the block's staging
        shared memory. Leaves the unnormalised Oᵀ in `o` and [max, sum] pairs of those rows
        (log2 domain, summed over the warp) in st[0:8]. `begin` is a multiple of 16.
        """
        warp = cuda.threadIdx.x >> 5
        for i in range(num_acc):
            o[i] = float32(0.0)
        for i in range(0, 8, 2):
            st[i], st[i + 1] = NEG_INF, float32(0.0)
        end = int32(end)
        last_pos = int32(end - 1)
        last_blk = block_div(last_pos)
        win, cur, nxt = start(tbl_ptr, begin, last_blk)
        k_src = k_ptr + int64(kv_head) * head_bytes
        v_src = v_ptr + int64(kv_head) * head_bytes
        smem = smem_addr(buf) + int32(warp * 2 * tile_bytes)  # this warp's K tile, then V
        s = cuda.local.array(8, float32)
        pf = cuda.local.array(8, uint32)
        rs = cuda.local.array(4, float32)
        tok0 = int32(begin + STEP * warp)
        v_tile = smem + tile_bytes
        if int32(tok0 + STEP) <= end:  # prologue: the first full step's tiles, one group each
            win, cur, nxt, lo, hi = locate(tbl_ptr, tok0, last_blk, win, cur, nxt)
            stage(smem, k_src, tok0, STEP, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()
            stage(v_tile, v_src, tok0, STEP, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()
        while int32(tok0 + STEP) <= end:  # full steps; warp-uniform trip count
            nt = int32(tok0 + STEP * num_warps)
            more = int32(nt + STEP) <= end
            cp_async_wait1()  # this step's K landed (its V may still be in flight)
            syncwarp()  # every lane's copies visible before any lane reads the tile
            scores_softmax(smem, tok0, causal, lims, last_pos, scale_log2, qf, st, s, pf, rs)
            syncwarp()  # K tile read by all lanes: free for the next step's copies
            if more:
                win, cur, nxt, lo, hi = locate(tbl_ptr, nt, last_blk, win, cur, nxt)
                stage(smem, k_src, nt, STEP, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()  # (an empty group when there is no next full step)
            cp_async_wait1()  # this step's V landed
            syncwarp()  # every lane's V copies visible before any lane reads the tile
            pv(v_tile, o, pf, rs, True, 0)
            syncwarp()  # V tile read: free
            if more:  # offsets again rather than hold them over the step (registers)
                lo, hi = offsets(nt, win, cur, nxt)
                stage(v_tile, v_src, nt, STEP, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()
            tok0 = nt
        if tok0 < end:  # the range's partial last step (one warp): zero-filled and masked
            win, cur, nxt, lo, hi = locate(tbl_ptr, tok0, last_blk, win, cur, nxt)
            valid = int32(end - tok0)
            stage(smem, k_src, tok0, valid, per_token, lo, hi, cur, nxt, win)
            stage(v_tile, v_src, tok0, valid, per_token, lo, hi, cur, nxt, win)
            cp_async_commit()
            cp_async_wait0()
            syncwarp()  # every lane's copies visible before any lane reads the tiles
            scores_softmax(smem, tok0, True, lims, last_pos, scale_log2, qf, st, s, pf, rs)
            pv(v_tile, o, pf, rs, True, 0)
        cp_async_wait0()  # no copy may outlive the loop: the merge reuses the buffer
        for i in range(1, 8, 2):  # each row's sum over the warp's 8 token lanes g
            total = st[i]
            total += shfl_xor(total, 4)
            total += shfl_xor(total, 8)
            st[i] = total + shfl_xor(total, 16)

    return attend


@cache
def make_tc_load_queries(spec: AttentionSpec) -> Any:
    """Device function: lane (g, c)'s B fragments of query rows g and 8+g (0 when not real):
    words (dims 16s + 2c, +1) and (16s + 8 + 2c, +1) of the row for every k-step s."""
    k_words, row_tiles = spec.head_dim // 8, spec.row_tiles

    @device_function
    def load_queries(row_g: Any, real_g: Any, row_g8: Any, real_g8: Any, qf: Any) -> None:
        c = cuda.laneid & 3
        for i in range(k_words * row_tiles):
            qf[i] = uint32(0)
        if real_g:
            for i in range(k_words):  # word index (16s + 8(i&1) + 2c) / 2
                qf[i] = ld_u32(row_g + 4 * (8 * (i >> 1) + 4 * (i & 1) + c))
        if row_tiles == 2 and real_g8:
            for i in range(k_words):
                qf[k_words + i] = ld_u32(row_g8 + 4 * (8 * (i >> 1) + 4 * (i & 1) + c))

    return load_queries


@cache
def make_tc_stage(spec: AttentionSpec) -> Any:
    """Device functions of the cross-warp merge (`_merge.py`) for the Oᵀ accumulators.

    `publish` puts each row's [max, sum] into ms/ls [warp, row]; `stage` writes this warp's
    accumulators of row tile `rt`, scaled by `row_factor`, into os [(warp * 8 + row) * D + dim].
    Lane (g, c) holds rows 2c, 2c+1 of each tile at dims 16j + g and 16j + g + 8.
    """
    head_dim, k_steps = spec.head_dim, spec.head_dim // 16
    _, row_factor = make_row_stats(spec.num_warps)

    @device_function
    def publish(st: Any, ms: Any, ls: Any) -> None:
        lane = cuda.laneid
        warp = cuda.threadIdx.x >> 5
        if lane < 4:  # lanes (0, c) hold rows 2c, 2c+1, 8+2c, 9+2c, like every (g, c)
            for i in range(4):
                r = 2 * lane + (i & 1) + 8 * (i >> 1)
                ms[warp, r] = st[2 * i]
                ls[warp, r] = st[2 * i + 1]

    @device_function
    def stage(o: Any, rt: Any, os: Any, ms: Any, ls: Any, normalize: Any) -> None:
        lane = cuda.laneid
        warp = cuda.threadIdx.x >> 5
        g = lane >> 2
        c = lane & 3
        f_a = row_factor(ms, ls, warp, rt * 8 + 2 * c, normalize)
        f_b = row_factor(ms, ls, warp, rt * 8 + 2 * c + 1, normalize)
        row_a = (warp * 8 + 2 * c) * head_dim
        row_b = row_a + head_dim
        base = rt * 4 * k_steps
        for j in range(k_steps):
            i = base + 4 * j
            os[row_a + 16 * j + g] = o[i] * f_a
            os[row_b + 16 * j + g] = o[i + 1] * f_b
            os[row_a + 16 * j + g + 8] = o[i + 2] * f_a
            os[row_b + 16 * j + g + 8] = o[i + 3] * f_b

    return publish, stage
