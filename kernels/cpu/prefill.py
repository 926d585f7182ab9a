"""CPU prefill attention: many query tokens per sequence, causal over the paged context.

Work item = (query tile, KV head), where a query tile is up to `QUERY_TILE` consecutive query
tokens of one sequence: `QUERY_TILE x group` query rows that share every K/V byte the item
reads. The item walks the context in key tiles of `KEY_TILE` keys (whole blocks), gathers each
tile's K and V once into contiguous float32 scratch (`_kv_block.gather_kv`: the paged layout,
fp16/bf16 widening and the transposes the two products want, paid once per tile for all rows),
then per four rows: scores (`score_rows`), one online-softmax update per key tile
(`softmax_rows`) and the probabilities times V (`accumulate_rows`). The causal mask is a
per-row key count (query j sees positions `0 … seq_len - q_len + j`), so only diagonal tiles
do partial rows and no masked key is ever read.

Why tiles: the previous kernel scored one row against one 16-key block at a time (a dot
product per key, an online-softmax rescale per block): ~9–11 G multiply-adds per CPU-second on
this project's 2-core VM. Four rows per loaded K/V vector and a rescale per 64 keys: ~12.5–13.5,
1.3x less CPU per layer (BENCHMARKS.md, "CPU prefill attention: key tiles"). What is left is
LLVM's horizontal sum per dot product; register-blocked products need control over vector
registers that Numba does not give (torch's SDPA, with its own micro-kernels, measured from
1.4x faster to 2.5x slower than this on these shapes, K/V gathered from the pages: no case for
splitting the per-layer call in two).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import prange

from kernels.cpu import _host, _parallel
from kernels.cpu._cache import njit_cached
from kernels.cpu._kv_block import accumulate_rows, gather_kv, score_rows, softmax_rows
from kernels.cpu._tile import FASTMATH

# 16 query tokens × group rows share one K/V tile load; the scratch for 16 × 8 rows × 128 dims
# (64 KB accumulator) still fits in L2.
QUERY_TILE = 16
# Keys per online-softmax step (whole blocks: max(1, KEY_TILE // block_size) of them).
KEY_TILE = 64


@njit_cached(fastmath=FASTMATH)
def prefill_tile(query, key_cache, value_cache, kv_kind, block_tables, seq_lens, query_start_loc,
                 s, row0, num_q, kv_head, scale, out):
    """Causal attention of query rows `row0 … row0 + num_q - 1` (all of sequence `s`) for the
    query heads of `kv_head`'s GQA group, into the same rows of `out`.

    query/out: [rows, num_heads, head_dim] float32; `query_start_loc[s]` is the row of the
    sequence's first query token (in the same row numbering as `row0`).
    key_cache/value_cache: [num_blocks, num_kv_heads, block_size, head_dim(*2 for fp32)] bits.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    h0 = kv_head * group
    q_len = query_start_loc[s + 1] - query_start_loc[s]
    pos0 = seq_lens[s] - q_len + (row0 - query_start_loc[s])  # absolute pos of row0
    num_rows = num_q * group
    q_rows = np.empty((num_rows, head_dim), np.float32)  # row r = j * group + g
    for j in range(num_q):
        for g in range(group):
            for d in range(head_dim):
                q_rows[j * group + g, d] = query[row0 + j, h0 + g, d] * scale
    blocks_per_tile = max(1, KEY_TILE // block_size)
    key_tile = blocks_per_tile * block_size
    m = np.full(num_rows, -np.inf, np.float32)
    l = np.zeros(num_rows, np.float32)
    acc = np.zeros((num_rows, head_dim), np.float32)
    scores = np.empty((num_rows + 4, key_tile), np.float32)  # + 4 rows: score_rows' spares
    visible = np.empty(num_rows, np.int64)
    k = np.empty((key_tile, head_dim), np.float32)
    vt = np.empty((head_dim, key_tile), np.float32)
    k_scratch = np.empty((block_size, head_dim), np.float32)
    v_scratch = np.empty((block_size, head_dim), np.float32)
    k_bits = k_scratch.view(np.uint32)
    v_bits = v_scratch.view(np.uint32)
    num_keys_total = pos0 + num_q  # keys the last query row sees
    for start in range(0, num_keys_total, key_tile):
        num_keys = min(key_tile, num_keys_total - start)
        gather_kv(key_cache, value_cache, kv_kind, block_tables[s], kv_head, start // block_size,
                  num_keys, k, vt, k_scratch, k_bits, v_scratch, v_bits)
        # Rows whose query sits before this tile's last key see a prefix of it (causal mask);
        # the first tile starts at key 0, so every row sees at least one key of it.
        first = 0  # first row that sees any key of this tile
        while first < num_rows and pos0 + first // group < start:
            first += 1
        for r in range(num_rows):
            visible[r] = min(num_keys, pos0 + r // group - start + 1)
        for r0 in range(first, num_rows, 4):
            nr = min(4, num_rows - r0)
            score_rows(q_rows, r0, nr, k, visible[r0 + nr - 1], scores, num_rows)
        for r0 in range(first, num_rows, 4):
            nr = min(4, num_rows - r0)
            for r in range(r0, r0 + nr):
                softmax_rows(scores, r, visible[r], m, l, acc)
            accumulate_rows(scores, r0, nr, visible, vt, acc)
    for j in range(num_q):
        for g in range(group):
            r = j * group + g
            inv = np.float32(1.0) / l[r]
            for d in range(head_dim):
                out[row0 + j, h0 + g, d] = acc[r, d] * inv


@njit_cached(parallel=True, fastmath=FASTMATH)
def _prefill_kernel(query, key_cache, value_cache, kv_kind, block_tables, seq_lens,
                    query_start_loc, tile_seq, tile_row, tile_len, scale, out):
    # tile_seq/tile_row/tile_len: [num_tiles] — sequence, first query row, query count
    num_kv_heads = key_cache.shape[1]
    for item in prange(tile_seq.shape[0] * num_kv_heads):
        tile = item // num_kv_heads
        prefill_tile(query, key_cache, value_cache, kv_kind, block_tables, seq_lens,
                     query_start_loc, tile_seq[tile], tile_row[tile], tile_len[tile],
                     item % num_kv_heads, scale, out)


def query_tiles(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every sequence's query rows split into tiles of at most QUERY_TILE rows: int32 (sequence,
    first row, row count) per tile, latest-position (longest-context, heaviest) tiles first so
    the dynamic scheduler starts the heavy items early instead of finishing on one straggler."""
    seqs, rows, lens = [], [], []
    for s in range(len(query_start_loc) - 1):
        begin, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        for row in range(begin, end, QUERY_TILE):
            seqs.append(s)
            rows.append(row)
            lens.append(min(QUERY_TILE, end - row))
    tile_seq = np.array(seqs, np.int32)
    tile_row = np.array(rows, np.int32)
    tile_len = np.array(lens, np.int32)
    order = np.argsort(-(seq_lens[tile_seq] - (query_start_loc[tile_seq + 1] - tile_row)), kind="stable")
    return tile_seq[order], tile_row[order], tile_len[order]


def prefill_work(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_heads: int) -> int:
    """Upper bound of (query, key) pairs x query heads: the attention work of a prefill call."""
    q_lens = np.diff(query_start_loc.astype(np.int64))
    return int((q_lens * seq_lens).sum()) * num_heads


def paged_prefill_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
    out: Any | None = None,
) -> Any:
    """Validated-argument entry point (see `kernels.paged_prefill_attention`)."""
    if out is None:
        out = _host.new_like(query)
    q = _host.query_f32(query)
    kc, kv_kind = _host.kv_bits(key_cache)
    vc, _ = _host.kv_bits(value_cache)
    tables = _host.index_array(block_tables, np.int32)
    lens = _host.index_array(seq_lens, np.int32)
    starts = _host.index_array(query_start_loc, np.int32)
    if q.shape[0] == 0:
        return out
    tile_seq, tile_row, tile_len = query_tiles(starts, lens)
    target = _host.f32_target(out)
    result = target if target is not None else np.empty(q.shape, np.float32)
    work = prefill_work(starts, lens, q.shape[1])
    with _parallel.parallel_section(work <= _parallel.SERIAL_MAX_ATTENTION_WORK):
        _prefill_kernel(q, kc, vc, kv_kind, tables, lens, starts, tile_seq, tile_row,
                        tile_len, np.float32(scale), result)
    if target is None:
        _host.store(out, result)
    return out
