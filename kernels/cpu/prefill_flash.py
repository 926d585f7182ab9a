"""CPU prefill attention for float32 caches through AVX2 register tiles: flash attention with
both products, S = Q·K^T and P·V, run by the GEMM's 6 x 16 FMA tile (`_gemm_tile`).

Why: the Numba tile kernel (`attend.prefill_tile`) leaves each dot product to LLVM, which ends it
in a horizontal sum, and torch's SDPA (`prefill_sdpa.py`) pays a gather of every sequence's
context per layer plus one call per sequence (a step of the shared-prefix workload is two dozen
short chunks, each over a 256-token prefix). On the project's 2-core AVX2 host, one thread,
both ran at ~30-45 GFLOP/s of a core's ~78 peak; this kernel at ~42 on a 1,024-token prompt
(its parts per 16-key tile of 96 rows, measured alone: S 2.1 µs, P·V 2.9, softmax 2.2 — 8.4 as
a plain Numba loop of `_tile.exp_f32`, which stayed scalar —, K/V packing 0.75).

Measured (`bench/bench_cpu_attention.py --one-thread`, per layer, CPU ms, loaded host, 2026-12-08
00:07; flash / SDPA): a shared-prefix prefill step (a 296-token prompt + 23 chunks of 16-64
after the cached 256) 20.7 / 21.5 at the 135M shape (9 / 3 heads), 34.2 / 36.9 at Qwen2.5-0.5B's
(14 / 2); a step of 8 prompts of 16-512 tokens 28.1 / 34.6 and 37.6 / 59.9. At contexts of 1-2k
it is at parity or behind (`MAX_DEFAULT_CONTEXT`), so those stay on SDPA by default.

Work item = (sequence, query tile, KV head): up to `QUERY_ROWS` query rows, `query_tokens(group)`
consecutive tokens (a sequence's rows cut into equal items) times the GQA group, which share every K/V byte the
item reads. The item copies its queries, pre-scaled, into a row-major scratch `qs [rows,
head_dim]`, then walks the context in key tiles of 16 keys (`KEY_TILE`, one 16-column panel):
  - packs the tile's K transposed into `kt [head_dim, 16]` and its V as head_dim / 16 panels
    `vp [head_dim / 16, 16 keys, 16]` (keys past the context zeroed, so a masked probability of
    0 never meets uninitialised memory), once for all the item's rows;
  - S = qs · kt through the tile, 6 rows at a time (`s [rows, 16]`);
  - masks keys past each row's causal limit (only on the diagonal tiles: a row at position p sees
    keys 0 … p; a chunk after a cached prefix sees the whole prefix), folds the tile into each
    row's running max and sum (online softmax, `_softmax_tile.softmax_row16`), rescales the
    row's accumulator when its max moved, and overwrites S with the probabilities;
  - O += P · vp, one tile per 16 output columns, accumulating in `o` itself.
At the end each row is divided by its sum and stored.

Like SDPA (and unlike the Numba tiles), masked keys of a diagonal tile are multiplied by a zero
probability, so a NaN in a later position's V of the same chunk would reach earlier rows (see
`prefill_sdpa.py` on why that is only ever a model that already diverged). Float32 caches only;
`usable` says when the shapes fit (head_dim a multiple of 16, block size a multiple of 16).
"""

from __future__ import annotations

import functools
import platform

import numpy as np
from llvmlite import binding as llvm
from numba import prange

from kernels.cpu._cache import njit_cached
from kernels.cpu._gemm_tile import PANEL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6
from kernels.cpu._softmax_tile import softmax_row16
from kernels.cpu.gemm import tile_rows

KEY_TILE = PANEL     # keys per tile: one 16-column panel of S
QUERY_ROWS = 128      # about this many query rows (tokens x group) share one packed K/V tile
# Contexts longer than this take torch's SDPA by default (`short_contexts`): per layer of both
# model shapes, one thread, loaded AVX2 host (bench/bench_cpu_attention.py and single-sequence
# cases, 2026-12-08): flash / SDPA CPU time 0.73-0.83 at a 512-token prompt, 0.90-0.95 at 768,
# 0.97-1.03 at 1,024, 0.94-1.23 at 1,536 and 1.03-1.06 for 512 rows after 1,536 cached keys.
MAX_DEFAULT_CONTEXT = 1024


def query_tokens(group: int) -> int:
    """Tokens per work item: QUERY_ROWS rows of the GQA group (at least one token)."""
    return max(1, QUERY_ROWS // group)


def usable(head_dim: int, block_size: int) -> bool:
    """Whether the shapes fit the kernel: whole 16-column panels over head_dim, whole key
    tiles per block."""
    return head_dim % PANEL == 0 and block_size % KEY_TILE == 0


@functools.cache
def preferred() -> bool:
    """Whether float32 prefill takes this kernel rather than torch's SDPA by default: an x86-64
    CPU with AVX2 and FMA but no AVX-512 (where the tile is written for and measured; with
    AVX-512, torch's SDPA computes twice as wide, the same rule as the dense layers' GEMM)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx2") and features.get("fma") and not features.get("avx512f"))


def short_contexts(seq_lens: np.ndarray) -> np.ndarray:
    """bool per sequence: whether its prefill rows take this kernel by default (context up to
    `MAX_DEFAULT_CONTEXT`); the longer ones take torch's SDPA."""
    return np.asarray(seq_lens) <= MAX_DEFAULT_CONTEXT


def flash_items(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int,
                group: int, only: np.ndarray | None = None) -> np.ndarray:
    """int32 [items, 4]: (sequence, first row, token count, KV head) per work item, the items of
    the latest-position (heaviest) query tiles first so the dynamic scheduler starts them early;
    `only`: bool per sequence, the sequences to cover (None: all)."""
    items = []
    for s in range(len(query_start_loc) - 1):
        if only is not None and not only[s]:
            continue
        begin, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        # the sequence's rows in equal items (40 tokens at 13 a piece: 4 x 10, not 13, 13, 13, 1:
        # a 1-token item would pack every K/V tile for a single group of rows)
        num_items = -(-(end - begin) // query_tokens(group))
        tokens = -(-(end - begin) // num_items) if num_items else 1
        for row in range(begin, end, tokens):
            n = min(tokens, end - row)
            last_pos = int(seq_lens[s]) - (end - row - n)   # keys the tile's last token sees
            for h in range(num_kv_heads):
                items.append((last_pos, s, row, n, h))
    items.sort(key=lambda item: -item[0])
    return np.array([item[1:] for item in items], np.int32).reshape(-1, 4)


@njit_cached(inline="always")
def _tile(rows, a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, zero_init):
    # c[r, :16] (= 0 or src[r, :16]) += a[r, :k_len] · b[:k_len, :16] for r < rows (1 … 6);
    # src's row stride is ldc. A literal row count per call: each intrinsic is compiled for it.
    if rows == 6:
        tile_6(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, ldc, zero_init, 0)
    elif rows == 5:
        tile_5(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, ldc, zero_init, 0)
    elif rows == 4:
        tile_4(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, ldc, zero_init, 0)
    elif rows == 3:
        tile_3(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, ldc, zero_init, 0)
    elif rows == 2:
        tile_2(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, ldc, zero_init, 0)
    else:
        tile_1(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, ldc, zero_init, 0)


@njit_cached()
def _pack_kv(key_cache, value_cache, block, kv_head, first, num_keys, kt, vp):
    # kt[d, j] = K[first + j, d]; vp[d // 16, j, d % 16] = V[first + j, d]; j >= num_keys zeroed
    head_dim = kt.shape[0]
    for j in range(KEY_TILE):
        if j < num_keys:
            k = key_cache[block, kv_head, first + j]
            v = value_cache[block, kv_head, first + j]
            for d in range(head_dim):
                kt[d, j] = k[d]
            for p in range(head_dim // PANEL):
                for c in range(PANEL):
                    vp[p, j, c] = v[p * PANEL + c]
        else:
            for d in range(head_dim):
                kt[d, j] = np.float32(0.0)
            for p in range(head_dim // PANEL):
                for c in range(PANEL):
                    vp[p, j, c] = np.float32(0.0)


@njit_cached()
def attend_keys(qs, key_cache, value_cache, table_row, kv_head, end_key, pos0, group, o, m, l):
    """Fold keys `0 … end_key` of one sequence's paged context (KV head `kv_head`) into the
    running state of every row of `qs` (pre-scaled queries `[rows, head_dim]`): `o` the
    unnormalised accumulator, `m` the running max, `l` the running sum (m = -inf, l = 0, o = 0
    to start). Row r is token r // group at position pos0 + r // group and sees keys 0 … that
    position: pass pos0 >= end_key - 1 for rows that see every key (no causal mask)."""
    rows, head_dim = qs.shape
    block_size = key_cache.shape[2]
    sc = np.empty((rows, KEY_TILE), np.float32)
    kt = np.empty((head_dim, KEY_TILE), np.float32)
    vp = np.empty((head_dim // PANEL, KEY_TILE, PANEL), np.float32)
    num_panels = head_dim // PANEL
    for key0 in range(0, end_key, KEY_TILE):
        num_keys = min(KEY_TILE, end_key - key0)
        block = table_row[key0 // block_size]
        _pack_kv(key_cache, value_cache, block, kv_head, key0 % block_size, num_keys, kt, vp)
        r = 0
        while r < rows:
            n = tile_rows(rows - r)
            _tile(n, qs, np.int64(r * head_dim), np.int64(head_dim), kt, np.int64(0), np.int64(head_dim),
                  sc, np.int64(r * KEY_TILE), np.int64(KEY_TILE), sc, np.int64(0), np.int64(1))
            r += n
        diagonal = key0 + KEY_TILE > pos0 + 1      # some row's causal limit falls inside the tile
        for r in range(rows):
            p = sc[r]
            if diagonal:
                for j in range(max(0, pos0 + r // group + 1 - key0), KEY_TILE):   # keys past the position
                    p[j] = np.float32(-np.inf)
            alpha = softmax_row16(sc, np.int64(r * KEY_TILE), m, l, np.int64(r))
            if alpha != np.float32(1.0):
                a = o[r]
                for d in range(head_dim):
                    a[d] *= alpha
        r = 0
        while r < rows:
            n = tile_rows(rows - r)
            for pnl in range(num_panels):
                at = np.int64(r * head_dim + pnl * PANEL)
                _tile(n, sc, np.int64(r * KEY_TILE), np.int64(KEY_TILE), vp, np.int64(pnl * KEY_TILE * PANEL),
                      np.int64(KEY_TILE), o, at, np.int64(head_dim), o, at, np.int64(0))
            r += n


@njit_cached(inline="always")
def scaled_group(query, row, kv_head, group, scale, qs, first):
    """Query row `row`'s heads of `kv_head`'s GQA group, times `scale`, into `qs[first:first + group]`
    (the tiles' A operand: one row per query head)."""
    for g in range(group):
        src = query[row, kv_head * group + g]
        dst = qs[first + g]
        for d in range(src.shape[0]):
            dst[d] = src[d] * scale


@njit_cached()
def flash_item(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, s, row0, num_tokens,
               kv_head, scale, out):
    """Attend query rows `row0 … row0 + num_tokens` of sequence `s`, the GQA group of `kv_head`,
    over its paged context; write them into `out` (same row/head layout as `query`)."""
    head_dim = query.shape[2]
    group = query.shape[1] // key_cache.shape[1]
    rows = num_tokens * group
    ctx = seq_lens[s]
    q_len = query_start_loc[s + 1] - query_start_loc[s]
    pos0 = ctx - q_len + (row0 - query_start_loc[s])     # position of the item's first token
    qs = np.empty((rows, head_dim), np.float32)
    for t in range(num_tokens):
        scaled_group(query, row0 + t, kv_head, group, scale, qs, t * group)
    o = np.zeros((rows, head_dim), np.float32)
    m = np.full(rows, -np.inf, np.float32)
    l = np.zeros(rows, np.float32)
    attend_keys(qs, key_cache, value_cache, block_tables[s], kv_head, pos0 + num_tokens, pos0, group, o, m, l)
    for t in range(num_tokens):
        for g in range(group):
            r = t * group + g
            inv = np.float32(1.0) / l[r]
            src = o[r]
            dst = out[row0 + t, kv_head * group + g]
            for d in range(head_dim):
                dst[d] = src[d] * inv


@njit_cached(parallel=True)
def _flash_parallel(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, items, scale, out):
    for i in prange(items.shape[0]):
        flash_item(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, items[i, 0],
                   items[i, 1], items[i, 2], items[i, 3], scale, out)


@njit_cached()
def _flash_serial(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, items, scale, out):
    for i in range(items.shape[0]):
        flash_item(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, items[i, 0],
                   items[i, 1], items[i, 2], items[i, 3], scale, out)


def flash_prefill(serial: bool, query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                  block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray, items: np.ndarray,
                  scale: np.float32, out: np.ndarray) -> None:
    """Run every item of `flash_items` (validated arrays: float32 query/out `[rows, heads,
    head_dim]`, float32 caches `[blocks, kv_heads, block_size, head_dim]`, int32 tables, lengths
    and the prefill rows' starts in the query's row numbering). The caller sets the threads
    (`_parallel.parallel_section`)."""
    run = _flash_serial if serial else _flash_parallel
    run(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, items, scale, out)
