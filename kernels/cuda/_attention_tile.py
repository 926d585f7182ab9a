"""The paged attention main loop shared by the decode, split-K and prefill kernels.

One thread block owns `num_rows` query rows that read the same KV head (the heads of one GQA
group, times a few query tokens for prefill), so every K/V byte is loaded from global memory
once per thread block, however many query heads share it. The loop walks the token range
tile by tile (a tile is a block, or an equal slice of a large block):

1. block-table entries are staged `prefetch_window` at a time in shared memory, so a tile
   load never waits on a dependent table read;
2. the *next* tile's K/V is loaded into registers while the current tile is being computed
   (software pipelining: the global loads are in flight during the math);
3. scores for (row, token) pairs → per-row online-softmax update (running max `m`, running
   sum `l`, rescale factor `alpha`) → accumulate `p·V` into per-thread float32 registers.

Tokens past the end of the range or after a row's causal limit are *clamped* to a valid token
for the load (the slot past a sequence's end may hold garbage, even NaN, and 0·NaN = NaN) and
masked out of the softmax.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32

from kernels.cuda._dtypes import NUMBA_STORAGE, loader
from kernels.cuda._spec import AttentionSpec

NEG_INF = float32(-math.inf)


@cache
def make_tile_attend(spec: AttentionSpec) -> Any:
    """Device function `attend(...)` for one variant (all shapes compile-time constants)."""
    head_dim = spec.head_dim
    block_size = spec.block_size
    num_rows = spec.num_rows
    num_threads = spec.num_threads
    tile_tokens = spec.tile_tokens
    window = spec.prefetch_window
    split = spec.score_split
    score_slots = num_rows * tile_tokens * split
    tile_elems = tile_tokens * head_dim
    tile_elems_per_thread = spec.tile_elems_per_thread
    acc_elems = num_rows * head_dim
    acc_elems_per_thread = spec.acc_elems_per_thread
    k_stride = head_dim + 1  # padded K rows: tokens of one warp hit different banks
    kv_type = NUMBA_STORAGE[spec.kv_kind]
    load_kv = loader(spec.kv_kind)

    @cuda.jit(device=True, inline=True)
    def load_window(block_tables: Any, seq: Any, first: Any, last_block: Any, tbl_sh: Any) -> None:
        # Entries past the last needed block are padding (maybe garbage): clamp to it.
        for i in range(cuda.threadIdx.x, window, num_threads):
            tbl_sh[i] = block_tables[seq, min(first + i, last_block)]

    @cuda.jit(device=True, inline=True)
    def load_tile(
        key_cache: Any, value_cache: Any, tbl_sh: Any, win: Any, kv_head: Any,
        tile_pos: Any, last_pos: Any, kreg: Any, vreg: Any,
    ) -> None:
        tid = cuda.threadIdx.x
        for j in range(tile_elems_per_thread):
            e = tid + j * num_threads
            if e < tile_elems:
                t = e // head_dim
                d = e - t * head_dim
                pos = min(tile_pos + t, last_pos)  # clamp: never read an invalid slot
                logical = pos // block_size
                block = tbl_sh[logical - win]
                offset = pos - logical * block_size
                # [num_blocks, num_kv_heads, block_size, head_dim]
                kreg[j] = key_cache[block, kv_head, offset, d]
                vreg[j] = value_cache[block, kv_head, offset, d]

    @cuda.jit(device=True)
    def attend(
        key_cache: Any, value_cache: Any, block_tables: Any, seq: Any, kv_head: Any,
        tok_begin: Any, tok_end: Any, q_sh: Any, limit_sh: Any, m_sh: Any, l_sh: Any, acc: Any,
    ) -> None:
        """Attend rows q_sh [num_rows, head_dim] to tokens tok_begin … tok_end-1.

        tok_begin must be a multiple of the tile size. Row r sees positions <= limit_sh[r].
        m_sh/l_sh/acc carry the online-softmax state in and out (acc unnormalised).
        """
        tid = cuda.threadIdx.x
        k_sh = cuda.shared.array((tile_tokens, k_stride), float32)  # [tile_tokens, head_dim+1]
        v_sh = cuda.shared.array((tile_tokens, head_dim), float32)  # [tile_tokens, head_dim]
        s_sh = cuda.shared.array(score_slots, float32)  # [num_rows, tile_tokens, split]
        p_sh = cuda.shared.array((num_rows, tile_tokens), float32)
        alpha_sh = cuda.shared.array(num_rows, float32)
        tbl_sh = cuda.shared.array(window, int32)
        kreg = cuda.local.array(tile_elems_per_thread, kv_type)
        vreg = cuda.local.array(tile_elems_per_thread, kv_type)

        if tok_end <= tok_begin:
            # Empty range (only reachable with untrusted device-side lengths): uniform across
            # the block, before any barrier; the caller then writes zeros (l == 0).
            return
        last_pos = tok_end - 1
        last_block = last_pos // block_size
        num_tiles = (tok_end - tok_begin + tile_tokens - 1) // tile_tokens
        win = tok_begin // block_size
        load_window(block_tables, seq, win, last_block, tbl_sh)
        # Why: tile 0's loads below read table entries other threads just staged.
        cuda.syncthreads()
        load_tile(key_cache, value_cache, tbl_sh, win, kv_head, tok_begin, last_pos, kreg, vreg)

        for it in range(num_tiles):
            # Why: every thread must be done reading the previous tile (k_sh, v_sh, p_sh,
            # alpha_sh) and the old table window before they are overwritten.
            cuda.syncthreads()
            for j in range(tile_elems_per_thread):
                e = tid + j * num_threads
                if e < tile_elems:
                    t = e // head_dim
                    d = e - t * head_dim
                    k_sh[t, d] = load_kv(kreg[j])
                    v_sh[t, d] = load_kv(vreg[j])
            next_pos = tok_begin + (it + 1) * tile_tokens
            has_next = it + 1 < num_tiles
            if has_next and next_pos // block_size >= win + window:
                win = next_pos // block_size  # uniform across the block
                load_window(block_tables, seq, win, last_block, tbl_sh)
            # Why: the staged tile and the (maybe refreshed) table window must be visible to
            # all threads before scoring and before the next tile's loads read the window.
            cuda.syncthreads()
            if has_next:
                load_tile(
                    key_cache, value_cache, tbl_sh, win, kv_head, next_pos, last_pos, kreg, vreg
                )

            tile_pos = tok_begin + it * tile_tokens
            for slot in range(tid, score_slots, num_threads):
                pair = slot // split
                part = slot - pair * split
                r = pair // tile_tokens
                t = pair - r * tile_tokens
                dot = float32(0.0)
                for d in range(part, head_dim, split):
                    dot += q_sh[r, d] * k_sh[t, d]
                s_sh[slot] = dot
            # Why: a row's softmax update reads the partial scores of all its tokens, which
            # other threads computed.
            cuda.syncthreads()
            for r in range(tid, num_rows, num_threads):
                limit = min(limit_sh[r], last_pos)
                tile_max = NEG_INF
                for t in range(tile_tokens):
                    if tile_pos + t <= limit:
                        base = (r * tile_tokens + t) * split
                        score = float32(0.0)
                        for part in range(split):
                            score += s_sh[base + part]
                        p_sh[r, t] = score
                        tile_max = max(tile_max, score)
                m_old = m_sh[r]
                m_new = max(m_old, tile_max)
                alpha = float32(1.0)
                total = float32(0.0)
                if m_new != NEG_INF:  # else the row saw no visible token yet: keep its state
                    alpha = math.exp(m_old - m_new)  # exp(-inf) = 0 on the first visible tile
                for t in range(tile_tokens):
                    p = float32(0.0)
                    if tile_pos + t <= limit:
                        p = math.exp(p_sh[r, t] - m_new)
                    p_sh[r, t] = p
                    total += p
                m_sh[r] = m_new
                l_sh[r] = l_sh[r] * alpha + total
                alpha_sh[r] = alpha
            # Why: the accumulation reads every row's probabilities and rescale factor.
            cuda.syncthreads()
            for j in range(acc_elems_per_thread):
                e = tid + j * num_threads
                if e < acc_elems:
                    r = e // head_dim
                    d = e - r * head_dim
                    a = acc[j] * alpha_sh[r]
                    for t in range(tile_tokens):
                        a += p_sh[r, t] * v_sh[t, d]
                    acc[j] = a

    return attend


@cache
def make_stage_queries(spec: AttentionSpec) -> Any:
    """Device function: scaled queries of one GQA group → q_sh; init per-row softmax state."""
    head_dim, rows, num_threads = spec.head_dim, spec.num_rows, spec.num_threads
    load_q = loader(spec.q_kind)

    @cuda.jit(device=True, inline=True)
    def stage(query: Any, seq: Any, kv_head: Any, scale: Any, last_pos: Any,
              q_sh: Any, limit_sh: Any, m_sh: Any, l_sh: Any) -> None:
        tid = cuda.threadIdx.x
        for e in range(tid, rows * head_dim, num_threads):
            r = e // head_dim
            d = e - r * head_dim
            # [num_seqs, num_heads, head_dim]; head = kv_head * group_size + r
            q_sh[r, d] = load_q(query[seq, kv_head * rows + r, d]) * scale
        for r in range(tid, rows, num_threads):
            limit_sh[r] = last_pos
            m_sh[r] = NEG_INF
            l_sh[r] = float32(0.0)

    return stage
