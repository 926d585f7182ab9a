"""CPU prefill attention: many query tokens per sequence, causal over the paged context.

The entry point and the query tiling live here; the work item (`attend.prefill_tile`) and the
loop that runs it are `attend.py`'s, shared with decode and the model step.

Work item = (query tile, KV head), where a query tile is up to `QUERY_TILE` consecutive query
tokens of one sequence: `QUERY_TILE x group` query rows that share every K/V byte the item
reads. The item walks the context in key tiles of `attend.KEY_TILE` keys (whole blocks), gathers each
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
1.4x faster to 2.5x slower than this on these shapes, K/V gathered from the pages, on an AVX2
host with an older torch). On an AVX-512 host with torch 2.13 SDPA is 3-4x faster, so float32
caches take it (`prefill_sdpa.py`) there; on an AVX2 host without AVX-512 they take the register-tile
flash kernel (`prefill_flash.py`, the products through the GEMM's FMA tile); fp16 and bf16 caches
take these tiles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernels.cpu import _host, _parallel, prefill_flash
from kernels.cpu.attend import attend_prefill
from kernels.cpu.prefill_sdpa import SdpaPrefill

# 16 query tokens × group rows share one K/V tile load; the scratch for 16 × 8 rows × 128 dims
# (64 KB accumulator) still fits in L2.
QUERY_TILE = 16


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
    target = _host.f32_target(out)
    result = target if target is not None else np.empty(q.shape, np.float32)
    if kv_kind == _host.KIND_F32 and prefill_flash.usable(kc.shape[3] // 2, kc.shape[2]) and prefill_flash.preferred():
        # the AVX2 register-tile kernel (prefill_flash.py) for short contexts and SDPA for the
        # long ones, as a model step does on this CPU
        short = prefill_flash.short_contexts(lens)
        items = prefill_flash.flash_items(starts, lens, kc.shape[1], q.shape[1] // kc.shape[1], short)
        serial = prefill_work(starts, lens, q.shape[1]) <= _parallel.SERIAL_MAX_ATTENTION_WORK
        with _parallel.parallel_section(serial):
            prefill_flash.flash_prefill(serial, q, kc.view(np.float32), vc.view(np.float32), tables, lens, starts,
                                        items, np.float32(scale), result)
        if not short.all():
            SdpaPrefill(tables, lens, starts, kc.shape[2], scale, ~short).run(
                torch.from_numpy(kc.view(np.float32)), torch.from_numpy(vc.view(np.float32)),
                torch.from_numpy(q), torch.from_numpy(result))
    elif kv_kind == _host.KIND_F32:   # torch's SDPA (prefill_sdpa.py), as a model step does
        sdpa = SdpaPrefill(tables, lens, starts, kc.shape[2], scale)
        sdpa.run(torch.from_numpy(kc.view(np.float32)), torch.from_numpy(vc.view(np.float32)),
                 torch.from_numpy(q), torch.from_numpy(result))
    else:
        tile_seq, tile_row, tile_len = query_tiles(starts, lens)
        work = prefill_work(starts, lens, q.shape[1])
        serial = work <= _parallel.SERIAL_MAX_ATTENTION_WORK
        with _parallel.parallel_section(serial):
            attend_prefill(serial, q, kc, vc, kv_kind, tables, lens, starts, tile_seq, tile_row,
                           tile_len, np.float32(scale), result)
    if target is None:
        _host.store(out, result)
    return out
