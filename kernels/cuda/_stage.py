"""Staging K/V tiles from the paged cache into a warp's shared memory with `cp.async`.

A warp copies the `tokens` rows of one step (one KV head's row = head_dim elements) into its
own buffer: 16-byte asynchronous copies that bypass registers and L1 (`cp.async.cg`), so the
next step's tile is in flight while the current one is computed and no register holds data
in transit. Rows are padded by 16 bytes in shared memory (`stride`): the 8 rows an `ldmatrix`
reads then fall in 8 different bank groups.

Lane assignment: copy i of lane l moves chunk `f % chunks` of row `f // chunks`, f = 32 i + l,
so every copy instruction reads whole 64-byte-or-larger runs of consecutive rows. When the
chunks per row divide 32 or are a multiple of 32 (every head_dim that is a multiple of 64
for 16-bit caches, of 32 for float32), each lane's addresses are one register per 8-row half
plus compile-time offsets, and a copy is one instruction.

Where the step's rows come from: `lo` (rows 0-7) and `hi` (rows 8-15) byte offsets into the
cache when each half lies in one block, or a table lookup per row (`token_off`, block sizes
that are not a multiple of 8). Rows at or past `valid` (the range ends inside the step) are
zero-filled without being read; their addresses still point into allocated blocks (the table
window repeats the last block for entries past it), so no copy can fault.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from numba import cuda, int32, uint32

from kernels.cuda._ops import (
    cp_async4,
    cp_async4_fill,
    cp_async8,
    cp_async8_fill,
    cp_async16,
    cp_async16_fill,
)
from kernels.cuda._runtime import device_function
from kernels.cuda._spec import WARP


def chunk_of(row_bytes: int) -> int:
    return 16 if row_bytes % 16 == 0 else 8 if row_bytes % 8 == 0 else 4


@cache
def tile_geometry(row_bytes: int, tokens: int) -> tuple[int, int, int, int]:
    """(chunk bytes, chunks per row, padded row stride in shared memory, tile bytes)."""
    chunk = chunk_of(row_bytes)
    stride = row_bytes + 16
    return chunk, row_bytes // chunk, stride, tokens * stride


@cache
def make_stager(row_bytes: int, tokens: int, half: int, token_off: Any) -> Any:
    """Device function `stage(dst, src, tok0, valid, per_token, lo, hi, cur, nxt, win)`.

    dst: the tile's shared address; src: the cache's address at this KV head; valid: rows that
    hold tokens of the range (`tokens` on a full step: a constant, and the check folds away);
    lo / hi: byte offsets of rows 0 and `half` (unused when `per_token`);
    `token_off(tok, lane_off, cur, nxt, win)` resolves a token through the warp's table window.
    """
    chunk, chunks, stride, _ = tile_geometry(row_bytes, tokens)
    total = tokens * chunks
    copies = -(-total // WARP)
    copy = {16: cp_async16, 8: cp_async8, 4: cp_async4}[chunk]
    copy_fill = {16: cp_async16_fill, 8: cp_async8_fill, 4: cp_async4_fill}[chunk]
    per_instr = WARP // chunks if WARP % chunks == 0 else 0  # rows per copy instruction
    per_row = chunks // WARP if chunks % WARP == 0 else 0  # copy instructions per row
    exact = copies * WARP == total  # no lane idles in any copy instruction
    # Every copy instruction's rows lie in one half: one register per half, constant offsets.
    fast = exact and ((per_instr and half % per_instr == 0) or per_row > 0)

    @device_function
    def put(dst: Any, src: Any, t: Any, valid: Any) -> None:
        if valid >= tokens:
            copy(dst, src)
        else:
            copy_fill(dst, src, uint32(chunk) if t < valid else uint32(0))

    @device_function
    def stage(dst: Any, src: Any, tok0: Any, valid: Any, per_token: Any, lo: Any, hi: Any,
              cur: Any, nxt: Any, win: Any) -> None:
        lane = cuda.laneid
        if fast and not per_token:
            lane_t = lane // chunks if per_instr else 0
            lane_k = lane % chunks if per_instr else lane
            lane_g = int32(lane_t * row_bytes + chunk * lane_k)
            g_lo = src + lo + lane_g
            g_hi = src + hi + lane_g
            s_lane = dst + int32(lane_t * stride + chunk * lane_k)
            for i in range(copies):
                t_base = i * per_instr if per_instr else i // per_row
                k_off = 0 if per_instr else (i % per_row) * WARP * chunk
                if t_base >= half:
                    g = g_hi + ((t_base - half) * row_bytes + k_off)
                else:
                    g = g_lo + (t_base * row_bytes + k_off)
                put(s_lane + (t_base * stride + k_off), g, int32(t_base + lane_t), valid)
            return
        for i in range(copies):
            f = int32(i * WARP + lane)
            t = int32(uint32(f) // uint32(chunks))
            k = int32(f - t * chunks)
            if exact or t < tokens:
                if per_token:
                    g = src + token_off(int32(tok0 + t), int32(chunk * k), cur, nxt, win)
                elif t >= half:
                    g = src + hi + int32((t - half) * row_bytes + chunk * k)
                else:
                    g = src + lo + int32(t * row_bytes + chunk * k)
                put(dst + int32(t * stride + chunk * k), g, t, valid)

    return stage
