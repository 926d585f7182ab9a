"""The body shared by the decode, split-K and prefill attention kernels.

A thread block owns up to 16 query rows that read one KV head and one token range of one
sequence; its warps split the range (`_tc_attend` / `_simt_attend`) and merge at the end
(`_merge`). The three kernels differ only in which rows they own, their causal limits, the
token range and where the merged rows go: each kernel file supplies a `row_source` and a
`row_target` device function.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32, uint32

from kernels.cuda._merge import chunk_dims, make_row_stats, make_store_chunk, make_sum_chunk
from kernels.cuda._ops import st_f32
from kernels.cuda._runtime import SIMULATOR, device_function
from kernels.cuda._spec import ROW_TILE, TC_STEP_TOKENS, AttentionSpec
from kernels.cuda._stage import tile_geometry
from kernels.cuda._tc_attend import make_tc_attend, make_tc_load_queries, make_tc_stage

NEG_INF = float32(-math.inf)


@cache
def make_block_attention(spec: AttentionSpec, row_source: Any, row_target: Any) -> Any:
    """Device function `run(...)`: attend, merge across warps, store every real row.

    `row_source(r, *src) -> (query address, real row?, last visible position)` and
    `row_target(r, *dst) -> (address, kind, [M, L] address)` map block row r (0..15) of the
    calling kernel; kind 0 = not a real row, 1 = normalised output in out_kind, 2 = split-K
    partial (float32 accumulator, then the row's max and sum as two float32).
    """
    tc = spec.path == "tc"
    if tc:
        publish, stage = make_tc_stage(spec)
        attend, load_queries = make_tc_attend(spec), make_tc_load_queries(spec)
        num_acc, q_words = spec.head_dim // 4 * spec.row_tiles, spec.head_dim // 8 * spec.row_tiles
        staging = spec.num_warps * 2 * tile_geometry(2 * spec.head_dim, TC_STEP_TOKENS)[3]
    else:
        from kernels.cuda._simt_attend import (
            make_simt_attend,
            make_simt_load_queries,
            make_simt_stage,
            simt_sizes,
        )

        publish, stage = make_simt_stage(spec)
        attend, load_queries = make_simt_attend(spec), make_simt_load_queries(spec, row_source)
        num_acc, q_words, staging = simt_sizes(spec)
    num_warps, head_dim, row_tiles = spec.num_warps, spec.head_dim, spec.row_tiles
    row_stats, _ = make_row_stats(num_warps)
    # One float32 buffer: the warps' K/V staging during the loop, the merge afterwards.
    buf_floats = max(staging // 4, num_warps * ROW_TILE * head_dim)
    chunk = chunk_dims(head_dim)
    chunks_per_row = head_dim // chunk
    items = ROW_TILE * chunks_per_row
    threads = spec.num_threads
    sum_chunk = make_sum_chunk(chunk, num_warps, head_dim)
    normalize = spec.mode != "split"
    store_out = make_store_chunk("f32" if spec.mode == "split" else spec.out_kind, chunk)
    out_bytes = 4 if spec.mode == "split" else {"f16": 2, "bf16": 2, "f32": 4}[spec.out_kind]
    q_type = uint32 if tc else float32
    state_rows = 2 * ROW_TILE
    state_len = 4 * ROW_TILE
    # cp.async and ldmatrix need 16-byte aligned shared addresses (Numba would align a
    # float32 array to 4); the simulator rejects any alignment argument but None.
    smem_align = None if SIMULATOR else 16

    @device_function
    def run(k_ptr: Any, v_ptr: Any, tbl_ptr: Any, kv_head: Any, begin: Any, end: Any,
            scale_log2: Any, s0: Any, s1: Any, s2: Any, s3: Any, s4: Any, s5: Any,
            t0: Any, t1: Any, t2: Any, t3: Any, t4: Any, t5: Any) -> None:
        buf = cuda.shared.array(buf_floats, float32, alignment=smem_align)
        ms = cuda.shared.array((num_warps, state_rows), float32)
        ls = cuda.shared.array((num_warps, state_rows), float32)
        o = cuda.local.array(num_acc, float32)
        qf = cuda.local.array(q_words, q_type)
        st = cuda.local.array(state_len, float32)
        vals = cuda.local.array(chunk, float32)
        lims = cuda.local.array(4, int32)
        if end > begin:  # uniform for the block
            if tc:
                g = cuda.laneid >> 2
                qa, real_a, _lim_a = row_source(g, s0, s1, s2, s3, s4, s5)
                qb, real_b, _lim_b = row_source(g + 8, s0, s1, s2, s3, s4, s5)
                load_queries(qa, real_a, qb, real_b, qf)
                c2 = 2 * (cuda.laneid & 3)
                for i in range(4):  # rows 2c, 2c+1, 8+2c, 9+2c: the lane's softmax rows
                    _q, _real, lim = row_source(c2 + (i & 1) + 8 * (i >> 1),
                                                         s0, s1, s2, s3, s4, s5)
                    lims[i] = min(lim, end - 1)
                attend(k_ptr, v_ptr, tbl_ptr, kv_head, begin, end, lims, scale_log2, qf, o, st,
                       buf)
            else:
                lim = load_queries(qf, s0, s1, s2, s3, s4, s5)
                attend(k_ptr, v_ptr, tbl_ptr, kv_head, begin, end, min(lim, end - 1),
                       scale_log2, qf, o, st, buf)
        else:  # nothing to attend (a zero length from the device): zero rows
            for i in range(num_acc):
                o[i] = float32(0.0)
            for i in range(state_len):
                st[i] = NEG_INF if i % 2 == 0 else float32(0.0)
        publish(st, ms, ls)
        # Why: every warp's per-row [max, sum] is read by all warps to scale and merge, and
        # no warp may still be reading its K/V staging buffer, which the merge overwrites.
        cuda.syncthreads()
        tid = cuda.threadIdx.x
        for rt in range(row_tiles):
            stage(o, rt, buf, ms, ls, normalize)
            # Why: the sums below read all warps' staged accumulators of this row tile.
            cuda.syncthreads()
            for item in range(tid, items, threads):
                tile_row = item // chunks_per_row
                r = rt * ROW_TILE + tile_row
                d0 = (item - tile_row * chunks_per_row) * chunk
                addr, kind, ml_addr = row_target(r, t0, t1, t2, t3, t4, t5)
                if kind != 0:
                    sum_chunk(buf, tile_row, d0, vals)
                    store_out(addr + d0 * out_bytes, vals)
                    if kind == 2 and d0 == 0:
                        big, total, _m_use = row_stats(ms, ls, r)
                        st_f32(ml_addr, big)
                        st_f32(ml_addr + 4, total)
            if rt + 1 < row_tiles:
                # Why: the next row tile overwrites the staging buffer others may still read.
                cuda.syncthreads()

    return run
