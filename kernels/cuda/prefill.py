"""Paged prefill attention: query tiles x paged KV, causal.

One thread block per (KV head, sequence, row tile). A sequence's query rows are its query
tokens x the heads of one GQA group, row `qt * group + h`; a row tile is `spec.rows` (16 on the
tensor-core path) consecutive rows, so each staged K/V tile serves that many rows. Query
token j of a sequence sits at absolute position `seq_len - q_len + j` and sees positions
0 … that position: the cached prefix plus the causal part of its own chunk. The block's warps
split the positions up to the tile's last visible one, and each row masks what it may not see.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, int32, int64

from kernels._validate import to_host_numpy
from kernels.cuda._attention_kernel import make_block_attention
from kernels.cuda._host import (
    ADDR,
    F32,
    I32,
    attention_ptrs,
    attention_spec,
    index_ptr,
    launch_bounds,
    output_for,
    scale_log2,
)
from kernels.cuda._ops import ld_s32
from kernels.cuda._runtime import device_function, jit_options, kind_of, launcher, stream_for
from kernels.cuda._spec import KIND_BYTES, AttentionSpec


@cache
def build_prefill_kernel(spec: AttentionSpec) -> Any:
    head_dim, group, num_heads, rows = spec.head_dim, spec.group_size, spec.num_heads, spec.rows
    q_row_bytes = head_dim * KIND_BYTES[spec.q_kind]
    out_row_bytes = head_dim * KIND_BYTES[spec.out_kind]

    @device_function
    def row_of(r: Any, row0: Any, q_len: Any) -> Any:
        """(query token clamped to the chunk, head, real row?) of block row r."""
        gr = int32(row0 + r)
        qt = int32(gr // group)
        real = r < rows and qt < q_len
        return min(qt, int32(q_len - 1)), int32(gr - qt * group), real

    @device_function
    def row_source(r: Any, q_ptr: Any, q_begin: Any, q_len: Any, kv_head: Any, row0: Any,
                   ctx_begin: Any) -> Any:
        qt, h, real = row_of(r, row0, q_len)
        # query: [total_query_tokens, num_heads, head_dim]
        addr = q_ptr + (int64(q_begin + qt) * num_heads + kv_head * group + h) * q_row_bytes
        return addr, real, int32(ctx_begin + qt)

    @device_function
    def row_target(r: Any, out_ptr: Any, q_begin: Any, q_len: Any, kv_head: Any, row0: Any,
                   unused: Any) -> Any:
        qt, h, real = row_of(r, row0, q_len)
        addr = out_ptr + (int64(q_begin + qt) * num_heads + kv_head * group + h) * out_row_bytes
        return addr, 1 if real else 0, addr

    run = make_block_attention(spec, row_source, row_target)

    def prefill_kernel(out_ptr: Any, q_ptr: Any, k_ptr: Any, v_ptr: Any, tbl_ptr: Any,
                       lens_ptr: Any, starts_ptr: Any, tbl_stride: Any, scale_log2: Any) -> None:
        kv_head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        row0 = int32(cuda.blockIdx.z * rows)
        q_begin = ld_s32(starts_ptr + 4 * seq)
        q_len = int32(ld_s32(starts_ptr + 4 * seq + 4) - q_begin)
        if row0 >= q_len * group:
            return  # a tile past this sequence's rows: uniform for the block, before any barrier
        seq_len = ld_s32(lens_ptr + 4 * seq)
        ctx_begin = int32(seq_len - q_len)  # absolute position of the chunk's first query
        last_qt = min(int32((row0 + rows - 1) // group), int32(q_len - 1))
        tok_end = int32(ctx_begin + last_qt + 1)  # the tile's last visible position + 1
        tbl = tbl_ptr + int64(seq) * tbl_stride * 4  # block_tables: [num_seqs, tbl_stride] int32
        run(k_ptr, v_ptr, tbl, kv_head, 0, tok_end, scale_log2,
            q_ptr, q_begin, q_len, kv_head, row0, ctx_begin,
            out_ptr, q_begin, q_len, kv_head, row0, 0)

    return prefill_kernel


PREFILL_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, I32, F32)


@cache
def prefill_kernel(spec: AttentionSpec) -> Any:
    return cuda.jit(PREFILL_SIGNATURE, **jit_options(launch_bounds(spec)))(
        build_prefill_kernel(spec))


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
    spec = attention_spec(query, key_cache, kind_of(out), "prefill")
    # Grid depth from the longest chunk when starts are on the host; otherwise from the total
    # (extra tiles exit at once) to avoid a device-to-host read.
    starts = to_host_numpy(query_start_loc)
    max_q_len = int(np.diff(starts).max()) if starts is not None else total_tokens
    num_tiles = max(1, math.ceil(max_q_len * spec.group_size / spec.rows))
    keep: list[Any] = []
    q, k, v, o = attention_ptrs(query, key_cache, value_cache, out)
    grid = (spec.num_kv_heads, num_seqs, num_tiles)
    launcher(prefill_kernel(spec), grid, spec.num_threads, stream_for(query, key_cache, out))(
        o, q, k, v, index_ptr(block_tables, key_cache, keep), index_ptr(seq_lens, key_cache, keep),
        index_ptr(query_start_loc, key_cache, keep), int(block_tables.shape[1]), scale_log2(scale))
    return out
