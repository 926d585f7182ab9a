"""Paged decode attention, one pass: one thread block per (sequence, KV head).

Each thread block stages the `group_size` query heads of one GQA group (pre-scaled, float32)
and walks the sequence's whole context with the shared tile loop (`_attention_tile`), so the
group's K/V bytes are read from global memory exactly once. Long contexts with few sequences
leave most SMs idle in this layout; `choose_num_partitions` then routes to the split-K variant
(`decode_split` + `decode_reduce`).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, float32, int32

from kernels.cuda import decode_split
from kernels.cuda._attention_tile import make_stage_queries, make_tile_attend
from kernels.cuda._dtypes import storer
from kernels.cuda._launch import (
    INT32_1D, INT32_2D, array_type, as_scale, attention_spec, output_for,
)
from kernels.cuda._runtime import (
    jit_options, num_sms, stream_for, to_kernel_array, to_kernel_index,
)
from kernels.cuda._spec import AttentionSpec

# Split-K partition length in tokens (rounded up to a multiple of the block size): long enough
# that the extra reduce pass (num_heads x partitions x head_dim floats) is small next to the
# K/V bytes a partition reads, short enough that a 4K context yields 8 partitions.
PARTITION_TOKENS = 512
# A grid of at least this many thread blocks per SM is considered to saturate memory bandwidth.
BLOCKS_PER_SM_TO_SATURATE = 4


def partition_size(block_size: int) -> int:
    return max(block_size, math.ceil(PARTITION_TOKENS / block_size) * block_size)


def choose_num_partitions(
    num_seqs: int, num_kv_heads: int, max_context: int, block_size: int, sm_count: int
) -> int:
    """Partitions per (sequence, KV head); 1 means the one-pass kernel.

    Dispatch rule: split only when the one-pass grid (num_seqs x num_kv_heads blocks) is too
    small to keep every SM busy (< BLOCKS_PER_SM_TO_SATURATE per SM) *and* the context spans
    more than one partition. `max_context` is the table capacity (max_blocks_per_seq x
    block_size), known from shapes alone, so no device-to-host read of seq_lens is needed.
    """
    parts = math.ceil(max_context / partition_size(block_size))
    if parts <= 1 or num_seqs * num_kv_heads >= BLOCKS_PER_SM_TO_SATURATE * sm_count:
        return 1
    return parts


@cache
def build_decode_kernel(spec: AttentionSpec) -> Any:
    """Python kernel function for one variant (compile with cuda.jit or compile_ptx)."""
    head_dim, rows, num_threads = spec.head_dim, spec.num_rows, spec.num_threads
    acc_per_thread = spec.acc_elems_per_thread
    attend = make_tile_attend(spec)
    stage = make_stage_queries(spec)
    store_out = storer(spec.out_kind)

    def decode_kernel(out: Any, query: Any, key_cache: Any, value_cache: Any,
                      block_tables: Any, seq_lens: Any, scale: Any) -> None:
        seq = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        q_sh = cuda.shared.array((rows, head_dim), float32)
        limit_sh = cuda.shared.array(rows, int32)
        m_sh = cuda.shared.array(rows, float32)
        l_sh = cuda.shared.array(rows, float32)
        acc = cuda.local.array(acc_per_thread, float32)
        for j in range(acc_per_thread):
            acc[j] = float32(0.0)
        seq_len = seq_lens[seq]
        stage(query, seq, kv_head, scale, seq_len - 1, q_sh, limit_sh, m_sh, l_sh)
        # Why: the tile loop reads queries and row state staged by other threads.
        cuda.syncthreads()
        attend(key_cache, value_cache, block_tables, seq, kv_head, 0, seq_len,
               q_sh, limit_sh, m_sh, l_sh, acc)
        # l_sh was last written before the tile loop's final barrier: visible here.
        for j in range(acc_per_thread):
            e = tid + j * num_threads
            if e < rows * head_dim:
                r = e // head_dim
                d = e - r * head_dim
                total = l_sh[r]
                value = acc[j] / total if total > float32(0.0) else float32(0.0)
                out[seq, kv_head * rows + r, d] = store_out(value)

    return decode_kernel


def decode_signature(spec: AttentionSpec) -> tuple[Any, ...]:
    from numba import types

    return (
        array_type(spec.out_kind, 3), array_type(spec.q_kind, 3),
        array_type(spec.kv_kind, 4), array_type(spec.kv_kind, 4),
        INT32_2D, INT32_1D, types.float32,
    )


@cache
def decode_kernel(spec: AttentionSpec) -> Any:
    return cuda.jit(**jit_options())(build_decode_kernel(spec))


def paged_attention_decode(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: float, out: Any | None = None, *, split: bool | None = None,
) -> Any:
    """Decode attention on the CUDA backend (arguments already validated); returns `out`.

    `split` forces the split-K (True) or one-pass (False) kernel; None applies
    `choose_num_partitions` (the dispatcher always passes None; checks force both paths).
    """
    out = output_for(query, out)
    num_seqs = int(query.shape[0])
    if num_seqs == 0:
        return out
    num_kv_heads, block_size = int(key_cache.shape[1]), int(key_cache.shape[2])
    max_context = int(block_tables.shape[1]) * block_size
    if split is None:
        parts = choose_num_partitions(num_seqs, num_kv_heads, max_context, block_size, num_sms())
        split = parts > 1
    if split:
        return decode_split.paged_attention_decode_split(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out,
            partition_size=partition_size(block_size),
        )
    spec = attention_spec(query, key_cache, out)
    kernel = decode_kernel(spec)
    stream = stream_for(query, key_cache, out)
    kernel[(num_seqs, num_kv_heads), spec.num_threads, stream](
        to_kernel_array(out), to_kernel_array(query),
        to_kernel_array(key_cache, cache_view=True), to_kernel_array(value_cache, cache_view=True),
        to_kernel_index(block_tables, key_cache), to_kernel_index(seq_lens, key_cache), as_scale(scale),
    )
    return out
