"""Split-K paged decode: one thread block per (sequence, KV head[, row block], partition).

A batch of a few long sequences gives the one-pass kernel fewer thread blocks than the GPU
holds at once. Here each sequence's context is cut into `num_parts` equal partitions sized by
its own length (multiples of 64 tokens; a short sequence leaves its last partitions empty and
they exit at once), each runs the shared block attention and leaves its unnormalised partial
state in float32 scratch; `decode_reduce` merges them. The scratch is [num_seqs, num_heads,
num_parts, head_dim] + [..., 2] — bounded by the partition count, never by table capacity —
and reused across calls (`_host.SCRATCH`).

Dispatch (`choose_num_partitions`): split only when the one-pass grid fills less than half of
what the GPU keeps resident (blocks per SM from the compiled kernel's real occupancy x SMs),
into as many partitions as fill it, each at least `MIN_PART_TOKENS` of the longest sequence.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from numba import cuda, int64

from kernels._validate import KernelInputError, to_host_numpy
from kernels.cuda._attention_kernel import make_block_attention
from kernels.cuda._host import (
    ADDR,
    F32,
    I32,
    SCRATCH,
    attention_ptrs,
    attention_spec,
    index_ptr,
    launch_bounds,
    output_for,
    scale_log2,
)
from kernels.cuda._ops import ld_s32
from kernels.cuda._runtime import (
    device_function,
    device_ptr,
    jit_options,
    kind_of,
    launcher,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES, AttentionSpec
from kernels.cuda.decode_reduce import MAX_PARTS, PART_ALIGN, launch_reduce, part_tokens

MIN_PART_TOKENS = 256  # a partition's K/V must outweigh its partial write + reduce read


def choose_num_partitions(base_grid: int, max_len: int, resident_blocks: int) -> int:
    """Partitions per (sequence, KV head); 1 means the one-pass kernel (module docstring)."""
    if 2 * base_grid >= resident_blocks:
        return 1
    by_length = math.ceil(max_len / MIN_PART_TOKENS)
    return max(1, min(resident_blocks // base_grid, by_length, MAX_PARTS))


@cache
def build_split_kernel(spec: AttentionSpec) -> Any:
    head_dim, group, num_heads = spec.head_dim, spec.group_size, spec.num_heads
    rows, row_blocks = spec.rows, spec.row_blocks
    q_row_bytes = head_dim * KIND_BYTES[spec.q_kind]

    @device_function
    def row_source(r: Any, q_ptr: Any, seq: Any, kv_head: Any, row0: Any, last: Any,
                   unused: Any) -> Any:
        head_row = row0 + r
        real = r < rows and head_row < group
        # query: [num_seqs, num_heads, head_dim]
        return q_ptr + (int64(seq) * num_heads + kv_head * group + head_row) * q_row_bytes, real, last

    @device_function
    def row_target(r: Any, tmp_o: Any, tmp_ml: Any, seq: Any, kv_head: Any, row0: Any,
                   part: Any) -> Any:
        head_row = row0 + r
        kind = 2 if r < rows and head_row < group else 0
        # tmp_o: [num_seqs, num_heads, num_parts, head_dim]; tmp_ml: [..., num_parts, 2]
        idx = (int64(seq) * num_heads + kv_head * group + head_row) * cuda.gridDim.z + part
        return tmp_o + idx * (4 * head_dim), kind, tmp_ml + idx * 8

    run = make_block_attention(spec, row_source, row_target)

    def split_kernel(tmp_o: Any, tmp_ml: Any, q_ptr: Any, k_ptr: Any, v_ptr: Any, tbl_ptr: Any,
                     lens_ptr: Any, tbl_stride: Any, scale_log2: Any) -> None:
        kv_head = cuda.blockIdx.x // row_blocks
        row0 = (cuda.blockIdx.x - kv_head * row_blocks) * rows
        seq = cuda.blockIdx.y
        part = cuda.blockIdx.z
        seq_len = ld_s32(lens_ptr + 4 * seq)
        per = part_tokens(seq_len, cuda.gridDim.z)
        begin = part * per
        if begin >= seq_len:
            return  # empty partition: uniform for the block, before any barrier; never read
        end = min(begin + per, seq_len)
        tbl = tbl_ptr + int64(seq) * tbl_stride * 4  # block_tables: [num_seqs, tbl_stride] int32
        run(k_ptr, v_ptr, tbl, kv_head, begin, end, scale_log2,
            q_ptr, seq, kv_head, row0, seq_len - 1, 0, tmp_o, tmp_ml, seq, kv_head, row0, part)

    return split_kernel


SPLIT_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, I32, F32)


@cache
def split_kernel(spec: AttentionSpec) -> Any:
    return cuda.jit(SPLIT_SIGNATURE, **jit_options(launch_bounds(spec)))(build_split_kernel(spec))


def partitions_for(spec: AttentionSpec, num_seqs: int, block_tables: Any, seq_lens: Any,
                   split: bool | None, resident: int) -> int:
    """The partition count of a call: the dispatch rule, or forced one-pass / split.

    The longest context comes from `seq_lens` when they are on the host; device-resident
    lengths are not read back (a synchronisation), the table capacity bounds them.
    """
    if split is False:
        return 1
    lens = to_host_numpy(seq_lens)
    max_len = int(lens.max()) if lens is not None else int(block_tables.shape[1]) * spec.block_size
    if split:
        return max(2, min(MAX_PARTS, math.ceil(max_len / PART_ALIGN)))
    return choose_num_partitions(num_seqs * spec.num_kv_heads * spec.row_blocks, max_len, resident)


MAX_GRID_YZ = 65_535  # CUDA's limit on grid.y and grid.z


def split_launch(spec: AttentionSpec, num_seqs: int, num_parts: int) -> tuple[tuple[int, int, int], int]:
    """(grid, scratch float32 words) of a split-K decode of `num_seqs` sequences.

    The scratch is [num_seqs, num_heads, num_parts, head_dim] partial outputs + [..., 2]
    (max, sum): at most MAX_PARTS x num_heads x (head_dim + 2) words per sequence, whatever
    the context length (a 1M-token sequence at 32 heads x d128: 1.1 MB). Raises
    `KernelInputError` when the grid cannot launch (more sequences than grid.y holds)."""
    if not 1 <= num_parts <= MAX_PARTS:
        raise KernelInputError(f"num_parts must be in [1, {MAX_PARTS}], got {num_parts}")
    if num_seqs > MAX_GRID_YZ:
        raise KernelInputError(f"{num_seqs} sequences exceed one split-K grid ({MAX_GRID_YZ})")
    grid = (spec.num_kv_heads * spec.row_blocks, num_seqs, num_parts)
    return grid, num_seqs * spec.num_heads * num_parts * (spec.head_dim + 2)


def paged_attention_decode_split(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: float, out: Any | None = None, *, num_parts: int,
) -> Any:
    """Split-K decode (validated arguments) into `num_parts` partitions per sequence."""
    if not 1 <= num_parts <= MAX_PARTS:
        raise KernelInputError(f"num_parts must be in [1, {MAX_PARTS}], got {num_parts}")
    out = output_for(query, out)
    num_seqs, num_heads, head_dim = (int(d) for d in query.shape)
    if num_seqs == 0:
        return out
    spec = attention_spec(query, key_cache, kind_of(out), "split")
    keep: list[Any] = []
    q, k, v, o = attention_ptrs(query, key_cache, value_cache, out)
    tables = index_ptr(block_tables, key_cache, keep)
    lens = index_ptr(seq_lens, key_cache, keep)
    rows = num_seqs * num_heads * num_parts
    grid, scratch_words = split_launch(spec, num_seqs, num_parts)
    scratch = SCRATCH.get(query, scratch_words)
    tmp_o = device_ptr(scratch)
    tmp_ml = tmp_o + rows * head_dim * 4
    stream = stream_for(query, key_cache, out)
    launcher(split_kernel(spec), grid, spec.num_threads, stream)(
        tmp_o, tmp_ml, q, k, v, tables, lens, int(block_tables.shape[1]), scale_log2(scale))
    launch_reduce(spec, num_seqs, num_parts, o, tmp_o, tmp_ml, lens, stream)
    return out
