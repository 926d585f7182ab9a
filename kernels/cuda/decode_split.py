"""Split-K paged decode attention: one thread block per (sequence, KV head, partition).

A batch of a few long sequences gives the one-pass kernel too few thread blocks to fill the
GPU. Here each partition of `partition_size` tokens (a multiple of the block size) runs the
shared tile loop independently and writes its unnormalised accumulator, running max and sum
to float32 scratch; `decode_reduce` merges them. Partitions past a sequence's end exit at
once (before any barrier, and uniformly for the whole block).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32, types

from kernels._validate import KernelInputError
from kernels.cuda._attention_tile import make_stage_queries, make_tile_attend
from kernels.cuda._launch import (
    FLOAT32_3D, FLOAT32_4D, INT32_1D, INT32_2D, array_type, as_scale, attention_spec, output_for,
)
from kernels.cuda._runtime import (
    empty_like_kind, jit_options, stream_for, to_kernel_array, to_kernel_index,
)
from kernels.cuda._spec import AttentionSpec
from kernels.cuda.decode_reduce import reduce_kernel


@cache
def build_split_kernel(spec: AttentionSpec, part_size: int) -> Any:
    head_dim, rows, num_threads = spec.head_dim, spec.num_rows, spec.num_threads
    acc_per_thread = spec.acc_elems_per_thread
    attend = make_tile_attend(spec)
    stage = make_stage_queries(spec)

    def split_kernel(tmp_out: Any, tmp_max: Any, tmp_sum: Any, query: Any, key_cache: Any,
                     value_cache: Any, block_tables: Any, seq_lens: Any, scale: Any) -> None:
        seq = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        part = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        seq_len = seq_lens[seq]
        tok_begin = part * part_size
        if tok_begin >= seq_len:
            return  # uniform for the whole block, before any barrier
        tok_end = min(tok_begin + part_size, seq_len)
        q_sh = cuda.shared.array((rows, head_dim), float32)
        limit_sh = cuda.shared.array(rows, int32)
        m_sh = cuda.shared.array(rows, float32)
        l_sh = cuda.shared.array(rows, float32)
        acc = cuda.local.array(acc_per_thread, float32)
        for j in range(acc_per_thread):
            acc[j] = float32(0.0)
        stage(query, seq, kv_head, scale, seq_len - 1, q_sh, limit_sh, m_sh, l_sh)
        # Why: the tile loop reads queries and row state staged by other threads.
        cuda.syncthreads()
        attend(key_cache, value_cache, block_tables, seq, kv_head, tok_begin, tok_end,
               q_sh, limit_sh, m_sh, l_sh, acc)
        for j in range(acc_per_thread):
            e = tid + j * num_threads
            if e < rows * head_dim:
                r = e // head_dim
                d = e - r * head_dim
                head = kv_head * rows + r
                # [num_seqs, num_heads, max_parts, head_dim]
                tmp_out[seq, head, part, d] = acc[j]
                if d == 0:
                    tmp_max[seq, head, part] = m_sh[r]
                    tmp_sum[seq, head, part] = l_sh[r]

    return split_kernel


def split_signature(spec: AttentionSpec) -> tuple[Any, ...]:
    return (
        FLOAT32_4D, FLOAT32_3D, FLOAT32_3D, array_type(spec.q_kind, 3),
        array_type(spec.kv_kind, 4), array_type(spec.kv_kind, 4), INT32_2D, INT32_1D,
        types.float32,
    )


@cache
def split_kernel(spec: AttentionSpec, part_size: int) -> Any:
    return cuda.jit(**jit_options())(build_split_kernel(spec, part_size))


def paged_attention_decode_split(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: float, out: Any | None = None, *, partition_size: int,
    num_threads: int | None = None,
) -> Any:
    """Split-K decode (validated arguments); `partition_size` a multiple of the block size."""
    block_size = int(key_cache.shape[2])
    if partition_size < block_size or partition_size % block_size != 0:
        raise KernelInputError(
            f"partition_size {partition_size} must be a positive multiple of block_size "
            f"{block_size}"
        )
    out = output_for(query, out)
    num_seqs, num_heads, head_dim = (int(d) for d in query.shape)
    if num_seqs == 0:
        return out
    num_kv_heads = int(key_cache.shape[1])
    max_parts = math.ceil(int(block_tables.shape[1]) * block_size / partition_size)
    spec = attention_spec(query, key_cache, out, num_threads=num_threads)
    tmp_out = empty_like_kind(query, (num_seqs, num_heads, max_parts, head_dim), "float32")
    tmp_max = empty_like_kind(query, (num_seqs, num_heads, max_parts), "float32")
    tmp_sum = empty_like_kind(query, (num_seqs, num_heads, max_parts), "float32")
    stream = stream_for(query, key_cache, out)
    lens = to_kernel_index(seq_lens, key_cache)
    scratch = (to_kernel_array(tmp_out), to_kernel_array(tmp_max), to_kernel_array(tmp_sum))
    split_kernel(spec, partition_size)[(num_seqs, num_kv_heads, max_parts), spec.num_threads, stream](
        *scratch, to_kernel_array(query),
        to_kernel_array(key_cache, cache_view=True), to_kernel_array(value_cache, cache_view=True),
        to_kernel_index(block_tables, key_cache), lens, as_scale(scale),
    )
    reduce = reduce_kernel(head_dim, spec.out_kind, spec.num_threads, partition_size)
    reduce[(num_seqs, num_heads), spec.num_threads, stream](to_kernel_array(out), *scratch, lens)
    return out
