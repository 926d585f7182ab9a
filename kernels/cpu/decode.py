"""CPU decode attention: one parallel work item per (sequence, KV head).

Each work item walks the sequence's block table once and scores every query head of its GQA
group against each K/V tile, so K/V bytes are read once per KV head. When there are too few
(sequence, KV head) items to keep every core busy and the context is long, the wrapper hands
off to the partitioned split-K kernel in `decode_split.py` instead.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import prange

from kernels.cpu import _host, _parallel
from kernels.cpu._cache import njit_cached
from kernels.cpu._tile import FASTMATH, attend_blocks
from kernels.cpu.decode_split import decode_split, num_partitions


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


@njit_cached(parallel=True, fastmath=FASTMATH)
def _decode_kernel(query, key_cache, value_cache, kv_kind, block_tables, seq_lens, scale, out):
    # query/out: [num_seqs, num_heads, head_dim] float32
    num_kv_heads = key_cache.shape[1]
    for item in prange(query.shape[0] * num_kv_heads):
        s = item // num_kv_heads
        decode_item(query, key_cache, value_cache, kv_kind, block_tables, seq_lens, s, s,
                    item % num_kv_heads, scale, out)


def use_split(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> bool:
    """Dispatch rule: split the context when (sequence, KV head) items cannot fill the cores.

    With fewer than two items per thread one long sequence leaves cores idle (and static
    scheduling makes ragged lengths worse); splitting pays once there are at least two
    partitions per sequence to spread.
    """
    num_items = num_seqs * num_kv_heads
    return num_items < 2 * numba.get_num_threads() and (
        num_partitions(max_seq_len, block_size) >= 2
    )


def paged_attention_decode(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: float,
    out: Any | None = None,
    split: bool | None = None,
) -> Any:
    """Validated-argument entry point (see `kernels.paged_attention_decode`).

    `split` forces the single-pass (False) or split-K (True) kernel; None applies `use_split`.
    """
    if out is None:
        out = _host.new_like(query)
    q = _host.query_f32(query)
    kc, kv_kind = _host.kv_bits(key_cache)
    vc, _ = _host.kv_bits(value_cache)
    tables = _host.index_array(block_tables, np.int32)
    lens = _host.index_array(seq_lens, np.int32)
    if q.shape[0] == 0:
        return out
    serial = int(lens.astype(np.int64).sum()) * q.shape[1] <= _parallel.SERIAL_MAX_ATTENTION_WORK
    if split is None:  # splitting only pays when more than one thread runs
        split = not serial and use_split(q.shape[0], kc.shape[1], int(lens.max()), kc.shape[2])
    target = _host.f32_target(out)
    result = target if target is not None else np.empty(q.shape, np.float32)
    with _parallel.parallel_section(serial):
        if split:
            decode_split(q, kc, vc, kv_kind, tables, lens, np.float32(scale), result)
        else:
            _decode_kernel(q, kc, vc, kv_kind, tables, lens, np.float32(scale), result)
    if target is None:
        _host.store(out, result)
    return out
