"""The CPU attention kernel: its work items and the one loop that runs them.

A work item is a decode (sequence, KV head) — `decode_item`, one query token over the whole
paged context —, a prefill (query tile, KV head) — `prefill_tile`, up to `prefill.QUERY_TILE`
causal query tokens of one sequence (prefill.py says how the tile is computed) — or a split-K
partition (sequence, KV head, partition) — `decode_split.partition_item`, merged afterwards by
the split-K reduce. `attend_serial` and `attend_parallel` are two compilations of one loop:
write a step's new K/V rows into the caches (none for the generic entry points), then run every
item, on the calling thread or handed out to all threads.

Why one loop for every caller (`paged_attention_decode`, single-pass or split,
`paged_prefill_attention` and a model step's `StepAttention`): Numba builds a `prange` loop as
four code libraries (the body as a gufunc, two wrappers, the caller), and each one optimises
and emits machine code for the whole inlined body again. Decode, split-K partitions and prefill
used to have a parallel loop each next to the step's loop over decode and prefill: the same
machine code compiled over and over, ~40% of the CPU a cold compile of every CPU kernel took
(BENCHMARKS.md, "Test-suite cost, round 15"). The results are the same bits: the items are
the same functions, each item writes its own rows.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from kernels.cpu._cache import njit_cached
from kernels.cpu._kv_block import accumulate_rows, gather_kv, score_rows, softmax_rows
from kernels.cpu._tile import FASTMATH, attend_blocks
from kernels.cpu.decode_split import NO_PARTIALS, Partials, partition_item
from kernels.cpu.write_slots import write_token

# Keys per online-softmax step (whole blocks: max(1, KEY_TILE // block_size) of them).
KEY_TILE = 64


@njit_cached(fastmath=FASTMATH)
def decode_item(query, key_cache, value_cache, kv_kind, block_tables, seq_lens, s, row, kv_head,
                scale, out):
    """Attention of sequence `s`'s one query token (row `row` of query/out) over its whole paged
    context, for the query heads of `kv_head`'s GQA group.

    query/out: [rows, num_heads, head_dim] float32;
    key_cache/value_cache: [num_blocks, num_kv_heads, block_size, head_dim(*2 for fp32)] bits.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    h0 = kv_head * group
    q_group = np.empty((group, head_dim), np.float32)
    for g in range(group):
        for d in range(head_dim):
            q_group[g, d] = query[row, h0 + g, d] * scale
    m = np.full(group, -np.inf, np.float32)
    l = np.zeros(group, np.float32)
    acc = np.zeros((group, head_dim), np.float32)
    seq_len = seq_lens[s]
    num_blocks = (seq_len + block_size - 1) // block_size
    attend_blocks(q_group, key_cache, value_cache, kv_kind, block_tables[s], seq_len,
                  kv_head, 0, num_blocks, m, l, acc)
    for g in range(group):
        inv = np.float32(1.0) / l[g]
        for d in range(head_dim):
            out[row, h0 + g, d] = acc[g, d] * inv


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


@njit_cached(fastmath=FASTMATH)
def attend_item(item, num_prefill_items, num_decode_items, query, key_cache, value_cache, kv_kind,
                dec_tables, dec_lens, pre_tables, pre_lens, pre_starts, tile_seq, tile_row, tile_len,
                blocks_per_partition, part_m, part_l, part_acc, scale, out):
    # Items [0, num_prefill_items): (prefill tile, KV head); then num_decode_items (decode
    # sequence, KV head), decode sequence s owning row s; then the split sequences' (sequence,
    # KV head, partition), split sequence s owning row s too (a step splits all or none).
    num_kv_heads = key_cache.shape[1]
    if item < num_prefill_items:
        tile = item // num_kv_heads
        prefill_tile(query, key_cache, value_cache, kv_kind, pre_tables, pre_lens, pre_starts,
                     tile_seq[tile], tile_row[tile], tile_len[tile], item % num_kv_heads, scale,
                     out)
    elif item < num_prefill_items + num_decode_items:
        item -= num_prefill_items
        s = item // num_kv_heads
        decode_item(query, key_cache, value_cache, kv_kind, dec_tables, dec_lens, s, s,
                    item % num_kv_heads, scale, out)
    else:
        partition_item(item - num_prefill_items - num_decode_items, query, key_cache, value_cache,
                       kv_kind, dec_tables, dec_lens, scale, blocks_per_partition, part_m, part_l,
                       part_acc)


@njit_cached(inline="always")
def _item_counts(key_cache, num_dec_seqs, tile_seq, part_m):
    # (prefill items, decode items, all items): the ranges attend_item tells apart
    num_kv_heads = key_cache.shape[1]
    num_prefill_items = tile_seq.shape[0] * num_kv_heads
    num_decode_items = num_dec_seqs * num_kv_heads
    num_items = num_prefill_items + num_decode_items + part_m.shape[0] * num_kv_heads * part_m.shape[2]
    return num_prefill_items, num_decode_items, num_items


@njit_cached()
def write_rows(key, value, key_cache, value_cache, slot_mapping):
    for t in range(key.shape[0]):
        write_token(key, value, key_cache, value_cache, slot_mapping, t)


@njit_cached(fastmath=FASTMATH)
def attend_serial(query, key, value, key_cache, value_cache, kv_kind, slot_mapping, dec_tables,
                  dec_lens, num_dec_seqs, pre_tables, pre_lens, pre_starts, tile_seq, tile_row,
                  tile_len, blocks_per_partition, part_m, part_l, part_acc, scale, out):
    # query/out: [num_tokens, num_heads, head_dim] float32, decode rows first;
    # key/value: [num_tokens, num_kv_heads, row] bits; caches: [num_blocks, num_kv_heads,
    # block_size, row] bits (row = head_dim, x2 for fp32); pre_starts and tile_row count rows
    # of the whole step (the first prefill row is after the decode rows, split or not);
    # part_*: decode_split.Partials of the split sequences (none: num_dec_seqs decode items).
    write_rows(key, value, key_cache, value_cache, slot_mapping)
    num_prefill_items, num_decode_items, num_items = _item_counts(key_cache, num_dec_seqs, tile_seq, part_m)
    for item in range(num_items):
        attend_item(item, num_prefill_items, num_decode_items, query, key_cache, value_cache, kv_kind,
                    dec_tables, dec_lens, pre_tables, pre_lens, pre_starts, tile_seq, tile_row,
                    tile_len, blocks_per_partition, part_m, part_l, part_acc, scale, out)


@njit_cached(parallel=True, fastmath=FASTMATH)
def attend_parallel(query, key, value, key_cache, value_cache, kv_kind, slot_mapping,
                    dec_tables, dec_lens, num_dec_seqs, pre_tables, pre_lens, pre_starts,
                    tile_seq, tile_row, tile_len, blocks_per_partition, part_m, part_l, part_acc,
                    scale, out):
    # Same as attend_serial. The writes stay on this thread, in a function compiled without
    # `parallel` (here each row's slice assignment would become a parallel region of its own):
    # a step's new K/V is a few MB at most (a 2048-token chunk of 3 fp32 KV heads of 64: 3 MB,
    # ~1 ms to copy), and a parallel write loop costs a second wake-up of the worker threads,
    # which on a loaded host can take a scheduler time slice (measured: the fused prefill
    # step at 0.7x the per-kernel calls with one; see _parallel.py).
    write_rows(key, value, key_cache, value_cache, slot_mapping)
    num_prefill_items, num_decode_items, num_items = _item_counts(key_cache, num_dec_seqs, tile_seq, part_m)
    for item in prange(num_items):
        # int64 as in attend_serial (prange's index is unsigned): one compilation of attend_item
        attend_item(np.int64(item), num_prefill_items, num_decode_items, query, key_cache, value_cache,
                    kv_kind, dec_tables, dec_lens, pre_tables, pre_lens, pre_starts, tile_seq,
                    tile_row, tile_len, blocks_per_partition, part_m, part_l, part_acc, scale, out)


# What the loops take for an absent kind of row (uint16 K/V and int64 slots as a step passes
# them, so every caller runs the same compiled signature).
NO_TABLES = np.zeros((0, 1), np.int32)
NO_INDEX = np.zeros(0, np.int32)
NO_STARTS = np.zeros(1, np.int32)
NO_SLOTS = np.zeros(0, np.int64)


def _no_rows(key_cache: np.ndarray) -> np.ndarray:
    # [0, num_kv_heads, row] bits: a step's K/V with no new token
    return np.empty((0, key_cache.shape[1], key_cache.shape[3]), key_cache.dtype)


def attend_decode(serial, split, query, key_cache, value_cache, kv_kind, block_tables, seq_lens, scale, out):
    """Decode attention of one query row per sequence (`query[s]` for sequence s) into `out`:
    single-pass, or `split` into partitions and merged (`decode_split`)."""
    loop = attend_serial if serial else attend_parallel
    no_rows = _no_rows(key_cache)
    num_seqs, num_heads, head_dim = query.shape
    partials = (Partials.new(num_seqs, num_heads, head_dim, int(seq_lens.max()), key_cache.shape[2])
                if split else NO_PARTIALS)
    loop(query, no_rows, no_rows, key_cache, value_cache, kv_kind, NO_SLOTS, block_tables, seq_lens,
         0 if split else num_seqs, NO_TABLES, NO_INDEX, NO_STARTS, NO_INDEX, NO_INDEX, NO_INDEX,
         *partials.args(), scale, out)
    if split:
        partials.reduce(out)


def attend_prefill(serial, query, key_cache, value_cache, kv_kind, block_tables, seq_lens, query_start_loc,
                   tile_seq, tile_row, tile_len, scale, out):
    """Causal prefill attention of every query tile (`prefill.query_tiles`) into `out`."""
    loop = attend_serial if serial else attend_parallel
    no_rows = _no_rows(key_cache)
    loop(query, no_rows, no_rows, key_cache, value_cache, kv_kind, NO_SLOTS, NO_TABLES, NO_INDEX, 0,
         block_tables, seq_lens, query_start_loc, tile_seq, tile_row, tile_len, *NO_PARTIALS.args(), scale, out)
