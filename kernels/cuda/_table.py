"""A warp's view of its sequence's block table, and where a step's rows live in the cache.

Every warp walks its own steps of `step` tokens. Block-table entries are read 32 at a time
(lane i holds entry `win + i`; indices past the range's last block repeat that block, so
nothing past it is ever dereferenced) with the next window prefetched one window ahead, and a
token's block is broadcast by a shuffle. When each half of a step lies in one block (block
size a multiple of the half), a step needs one or two shuffles and its rows are addressed from
two byte offsets (`lo`, `hi`); otherwise every row is looked up (`token_off`).
Cache layout: [num_blocks, num_kv_heads, block_size, head_dim]; token and offset arithmetic is
32-bit, only a block's byte offset is 64-bit.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

from numba import cuda, int32, int64, uint32

from kernels.cuda._ops import ld_s32, shfl_idx
from kernels.cuda._runtime import device_function

WINDOW = 32  # block-table entries per warp window: one per lane


@cache
def make_paging(block_size: int, num_kv_heads: int, row_bytes: int, step: int,
                num_warps: int) -> SimpleNamespace:
    """Device functions `block_div`, `lookup`, `advance`, `token_off`, `offsets`, `locate` and
    the flags `per_token`, `half` for one geometry (see the module docstring)."""
    pow2 = block_size & (block_size - 1) == 0
    log_bs = block_size.bit_length() - 1
    block_bytes = num_kv_heads * block_size * row_bytes
    half = step // 2 if step > 1 else 1
    one_block = block_size % step == 0
    two_blocks = not one_block and step % 2 == 0 and block_size % half == 0
    per_token = not (one_block or two_blocks)
    jumps = step * num_warps // block_size > WINDOW  # a warp's next step may skip a window

    @device_function
    def block_div(pos: Any) -> Any:
        return int32(pos >> log_bs) if pow2 else int32(uint32(pos) // uint32(block_size))

    @device_function
    def lookup(cur: Any, nxt: Any, idx: Any) -> Any:
        """Entry `win + idx` for 0 <= idx < 2 * WINDOW (this window or the next)."""
        a = shfl_idx(cur, idx & (WINDOW - 1))
        b = shfl_idx(nxt, idx & (WINDOW - 1))
        return a if idx < WINDOW else b

    @device_function
    def advance(tbl_ptr: Any, first_blk: Any, last_blk: Any, win: Any, cur: Any, nxt: Any) -> Any:
        """(win, cur, nxt) with first_blk inside the current window."""
        lane = cuda.laneid
        if first_blk >= int32(win + WINDOW):  # warp-uniform
            if jumps:
                win = int32(first_blk & ~(WINDOW - 1))
                cur = ld_s32(tbl_ptr + 4 * min(int32(win + lane), last_blk))
            else:
                win = int32(win + WINDOW)
                cur = nxt
            nxt = ld_s32(tbl_ptr + 4 * min(int32(win + WINDOW + lane), last_blk))  # prefetch
        return win, cur, nxt

    @device_function
    def token_off(tok: Any, lane_off: Any, cur: Any, nxt: Any, win: Any) -> Any:
        """Byte offset of a token's row (+ lane_off) in the cache, at KV head 0."""
        blk = block_div(tok)
        entry = lookup(cur, nxt, int32(blk - win))
        return int64(entry) * block_bytes + int32(lane_off + int32(tok - blk * block_size) * row_bytes)

    @device_function
    def offsets(tok0: Any, win: Any, cur: Any, nxt: Any) -> Any:
        """Byte offsets of step tok0's rows 0 and `half` (the window must cover the step)."""
        lo = int64(0)
        hi = int64(0)
        if not per_token:
            first_blk = block_div(tok0)
            lo = (int64(shfl_idx(cur, int32(first_blk - win))) * block_bytes
                  + int32(int32(tok0 - first_blk * block_size) * row_bytes))
            hi = lo + int32(half * row_bytes)
            if two_blocks:
                hi_blk = block_div(int32(tok0 + half))
                hi = (int64(lookup(cur, nxt, int32(hi_blk - win))) * block_bytes
                      + int32(int32(tok0 + half - hi_blk * block_size) * row_bytes))
        return lo, hi

    @device_function
    def locate(tbl_ptr: Any, tok0: Any, last_blk: Any, win: Any, cur: Any, nxt: Any) -> Any:
        """(win, cur, nxt, lo, hi): the window advanced to step tok0, and its row offsets."""
        win, cur, nxt = advance(tbl_ptr, block_div(tok0), last_blk, win, cur, nxt)
        lo, hi = offsets(tok0, win, cur, nxt)
        return win, cur, nxt, lo, hi

    @device_function
    def start(tbl_ptr: Any, begin: Any, last_blk: Any) -> Any:
        """(win, cur, nxt): the windows covering `begin` and the one after it."""
        lane = cuda.laneid
        win = int32(block_div(begin) & ~(WINDOW - 1))
        cur = ld_s32(tbl_ptr + 4 * min(int32(win + lane), last_blk))
        nxt = ld_s32(tbl_ptr + 4 * min(int32(win + WINDOW + lane), last_blk))
        return win, cur, nxt

    return SimpleNamespace(block_div=block_div, lookup=lookup, advance=advance,
                           token_off=token_off, offsets=offsets, locate=locate, start=start,
                           per_token=per_token, half=half)
