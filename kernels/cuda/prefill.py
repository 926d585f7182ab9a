"""Paged prefill attention: query tiles x paged KV, causal.

One thread block per (sequence, KV head, query tile). A query tile is `query_tile`
consecutive query tokens of one sequence times the `group_size` heads of one GQA group, so
each K/V tile staged in shared memory serves `query_tile * group_size` rows. Query token j of
a sequence (0-based within its q_len) sits at absolute position `seq_len - q_len + j` and sees
positions 0 … that position: the cached prefix plus the causal part of its own chunk. The
tile loop stops after the tile's last visible position, so later KV is never loaded.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, int32, types

from kernels._validate import to_host_numpy
from kernels.cuda._attention_tile import NEG_INF, make_tile_attend
from kernels.cuda._dtypes import loader, storer
from kernels.cuda._launch import (
    INT32_1D, INT32_2D, array_type, as_scale, attention_spec, output_for,
)
from kernels.cuda._runtime import (
    jit_options, stream_for, to_kernel_array, to_kernel_index,
)
from kernels.cuda._spec import AttentionSpec, prefill_query_tile


@cache
def build_prefill_kernel(spec: AttentionSpec) -> Any:
    head_dim, rows, num_threads = spec.head_dim, spec.num_rows, spec.num_threads
    group, query_tile = spec.group_size, spec.query_tile
    acc_per_thread = spec.acc_elems_per_thread
    attend = make_tile_attend(spec)
    load_q = loader(spec.q_kind)
    store_out = storer(spec.out_kind)

    def prefill_kernel(out: Any, query: Any, key_cache: Any, value_cache: Any,
                       block_tables: Any, seq_lens: Any, query_start_loc: Any,
                       scale: Any) -> None:
        seq = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        first_q = cuda.blockIdx.z * query_tile  # 0-based within the sequence's queries
        tid = cuda.threadIdx.x
        q_begin = query_start_loc[seq]
        q_len = query_start_loc[seq + 1] - q_begin
        if first_q >= q_len:
            return  # uniform for the whole block, before any barrier
        seq_len = seq_lens[seq]
        ctx_begin = seq_len - q_len  # absolute position of query 0
        q_sh = cuda.shared.array((rows, head_dim), float32)
        limit_sh = cuda.shared.array(rows, int32)
        m_sh = cuda.shared.array(rows, float32)
        l_sh = cuda.shared.array(rows, float32)
        acc = cuda.local.array(acc_per_thread, float32)
        for j in range(acc_per_thread):
            acc[j] = float32(0.0)
        # Row r = (query qt = r // group, head g = r % group); rows past q_len duplicate the
        # last query (valid loads, finite math) and are never written out.
        for e in range(tid, rows * head_dim, num_threads):
            r = e // head_dim
            d = e - r * head_dim
            qt = min(first_q + r // group, q_len - 1)
            # [total_query_tokens, num_heads, head_dim]
            q_sh[r, d] = load_q(query[q_begin + qt, kv_head * group + r % group, d]) * scale
        for r in range(tid, rows, num_threads):
            limit_sh[r] = ctx_begin + min(first_q + r // group, q_len - 1)
            m_sh[r] = NEG_INF
            l_sh[r] = float32(0.0)
        # Why: the tile loop reads queries and row limits staged by other threads.
        cuda.syncthreads()
        tok_end = ctx_begin + min(first_q + query_tile, q_len)  # last visible position + 1
        attend(key_cache, value_cache, block_tables, seq, kv_head, 0, tok_end,
               q_sh, limit_sh, m_sh, l_sh, acc)
        for j in range(acc_per_thread):
            e = tid + j * num_threads
            if e < rows * head_dim:
                r = e // head_dim
                d = e - r * head_dim
                qt = first_q + r // group
                if qt < q_len:
                    total = l_sh[r]
                    value = acc[j] / total if total > float32(0.0) else float32(0.0)
                    out[q_begin + qt, kv_head * group + r % group, d] = store_out(value)

    return prefill_kernel


def prefill_signature(spec: AttentionSpec) -> tuple[Any, ...]:
    return (
        array_type(spec.out_kind, 3), array_type(spec.q_kind, 3),
        array_type(spec.kv_kind, 4), array_type(spec.kv_kind, 4),
        INT32_2D, INT32_1D, INT32_1D, types.float32,
    )


@cache
def prefill_kernel(spec: AttentionSpec) -> Any:
    return cuda.jit(**jit_options())(build_prefill_kernel(spec))


def paged_prefill_attention(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    query_start_loc: Any, scale: float, out: Any | None = None,
) -> Any:
    """Prefill attention on the CUDA backend (arguments already validated); returns `out`."""
    out = output_for(query, out)
    num_seqs = int(block_tables.shape[0])
    total_tokens = int(query.shape[0])
    if num_seqs == 0 or total_tokens == 0:
        return out
    num_kv_heads = int(key_cache.shape[1])
    group = int(query.shape[1]) // num_kv_heads
    spec = attention_spec(query, key_cache, out, query_tile=prefill_query_tile(group))
    # Grid depth from the longest chunk when starts are on the host; otherwise the total
    # (extra tiles exit at once) to avoid a device-to-host read.
    starts = to_host_numpy(query_start_loc)
    max_q_len = int(np.diff(starts).max()) if starts is not None else total_tokens
    num_tiles = max(1, math.ceil(max_q_len / spec.query_tile))
    stream = stream_for(query, key_cache, out)
    prefill_kernel(spec)[(num_seqs, num_kv_heads, num_tiles), spec.num_threads, stream](
        to_kernel_array(out), to_kernel_array(query),
        to_kernel_array(key_cache, cache_view=True), to_kernel_array(value_cache, cache_view=True),
        to_kernel_index(block_tables, key_cache), to_kernel_index(seq_lens, key_cache),
        to_kernel_index(query_start_loc, key_cache), as_scale(scale),
    )
    return out
