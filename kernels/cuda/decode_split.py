"""Split-K paged decode: one thread block per (work item, KV head[, row block]).

A batch of a few long sequences gives the one-pass kernel fewer thread blocks than the GPU
holds at once. Here each sequence's context is cut into partitions (`decode_policy`: a common
chunk size, so a long sequence gets more partitions than a short one), each partition is a
work item, and each item runs the shared block attention and leaves its unnormalised partial
state in float32 scratch; `decode_reduce` merges them.

The work list (`decode_policy.work_items`, one device int32 array) holds the sequence of each
item (-1 for a padded item: a graph bucket sized for its worst case) and each sequence's first
item; a sequence with n items cuts its own length into n equal partitions of whole 64-token
steps (`part_tokens`), so the same list serves lengths that change between graph replays (a
partition past the end exits at once, and the reduce reads only those written). Scratch is
[items, num_heads, head_dim] + [..., 2], reused across calls (`_host.SCRATCH`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from numba import cuda, int64

from kernels._validate import KernelInputError, to_host_numpy
from kernels.cuda import decode_policy
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
from kernels.cuda._kernel_cache import compile_kernel
from kernels.cuda._ops import ld_s32
from kernels.cuda._runtime import (
    device_function,
    device_ptr,
    kind_of,
    launcher,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES, AttentionSpec
from kernels.cuda.decode_policy import Occupancy
from kernels.cuda.decode_reduce import MAX_PARTS, PART_ALIGN, launch_reduce, part_tokens


def choose_num_partitions(base_grid: int, max_len: int, occupancy: Occupancy) -> int:
    """Partitions per sequence of a uniform batch (`base_grid` = sequences x KV heads x row
    blocks, each of `max_len` tokens); 1 means the one-pass kernel. `occupancy`: the resident
    blocks of both kernels (`decode.resident_blocks`)."""
    return decode_policy.uniform_parts(base_grid, max_len, 1, occupancy)


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
    def row_target(r: Any, tmp_o: Any, tmp_ml: Any, item: Any, kv_head: Any, row0: Any,
                   unused: Any) -> Any:
        head_row = row0 + r
        kind = 2 if r < rows and head_row < group else 0
        # tmp_o: [items, num_heads, head_dim]; tmp_ml: [items, num_heads, 2]
        idx = int64(item) * num_heads + kv_head * group + head_row
        return tmp_o + idx * (4 * head_dim), kind, tmp_ml + idx * 8

    run = make_block_attention(spec, row_source, row_target)

    def split_kernel(tmp_o: Any, tmp_ml: Any, q_ptr: Any, k_ptr: Any, v_ptr: Any, tbl_ptr: Any,
                     lens_ptr: Any, seq_of_ptr: Any, first_ptr: Any, tbl_stride: Any,
                     scale_log2: Any) -> None:
        kv_head = cuda.blockIdx.x // row_blocks
        row0 = (cuda.blockIdx.x - kv_head * row_blocks) * rows
        item = cuda.blockIdx.y
        seq = ld_s32(seq_of_ptr + 4 * item)
        if seq < 0:
            return  # a padded item: uniform for the block, before any barrier; never read
        first = ld_s32(first_ptr + 4 * seq)
        part = item - first
        seq_len = ld_s32(lens_ptr + 4 * seq)
        per = part_tokens(seq_len, ld_s32(first_ptr + 4 * seq + 4) - first)
        begin = part * per
        if begin >= seq_len:
            return  # empty partition: uniform for the block, before any barrier; never read
        end = min(begin + per, seq_len)
        tbl = tbl_ptr + int64(seq) * tbl_stride * 4  # block_tables: [num_seqs, tbl_stride] int32
        run(k_ptr, v_ptr, tbl, kv_head, begin, end, scale_log2,
            q_ptr, seq, kv_head, row0, seq_len - 1, 0, tmp_o, tmp_ml, item, kv_head, row0, 0)

    return split_kernel


SPLIT_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, I32, F32)


@cache
def split_kernel(spec: AttentionSpec) -> Any:
    """The split-K kernel of a variant (compiled or loaded as `decode.decode_kernel`)."""
    return compile_kernel(build_split_kernel(spec), SPLIT_SIGNATURE, launch_bounds(spec),
                          f"split {spec!r}")


def parts_for(spec: AttentionSpec, num_seqs: int, block_tables: Any, seq_lens: Any,
              split: bool | None, occupancy: Occupancy | None) -> np.ndarray | None:
    """Partitions per sequence of a call (int32 [num_seqs]), or None for the one-pass kernel:
    the policy, or forced one-pass (False) / split (True: 64-token partitions, at most
    MAX_PARTS). The policy sees the lengths when they are on the host; device-resident
    lengths are not read back (a synchronisation): every sequence is then taken at the table
    capacity, partitioned alike, and the kernel cuts each by its own length."""
    if split is False or num_seqs == 0:
        return None
    host = to_host_numpy(seq_lens)
    if host is None:  # device lengths: every sequence at the table capacity
        lens = np.full(num_seqs, int(block_tables.shape[1]) * spec.block_size, np.int64)
    else:
        lens = np.asarray(host, dtype=np.int64)
    if split:
        return np.clip(-(-lens // PART_ALIGN), 2, MAX_PARTS).astype(np.int32)
    if occupancy is None:
        raise KernelInputError("the split policy needs the kernels' occupancy")
    return decode_policy.split_parts(lens, spec.num_kv_heads * spec.row_blocks, occupancy)


MAX_GRID_YZ = 65_535  # CUDA's limit on grid.y and grid.z


def split_launch(spec: AttentionSpec, num_items: int) -> tuple[tuple[int, int], int]:
    """(grid, scratch float32 words) of a split-K decode of `num_items` work items.

    The scratch is [items, num_heads, head_dim] partial outputs + [..., 2] (max, sum): at
    most MAX_PARTS x num_heads x (head_dim + 2) words per sequence, whatever the context
    length (a 1M-token sequence at 32 heads x d128: 1.1 MB). Raises `KernelInputError` when
    the grid cannot launch (more items than grid.y holds)."""
    if num_items > MAX_GRID_YZ:
        raise KernelInputError(f"{num_items} split-K work items exceed one grid ({MAX_GRID_YZ})")
    grid = (spec.num_kv_heads * spec.row_blocks, max(1, num_items))
    return grid, max(1, num_items) * spec.num_heads * (spec.head_dim + 2)


def launch_split(spec: AttentionSpec, num_seqs: int, num_items: int, ptrs: tuple[Any, ...],
                 tables: Any, lens: Any, work: Any, tbl_stride: int, scale: float,
                 scratch: Any, stream: Any) -> None:
    """The split kernel and the reduce over a work list at device address `work`
    (`decode_policy.work_items` for `num_items` items): ptrs = (query, keys, values, out)."""
    q, k, v, o = ptrs
    grid, _ = split_launch(spec, num_items)
    tmp_o = device_ptr(scratch)
    tmp_ml = tmp_o + grid[1] * spec.num_heads * spec.head_dim * 4
    first = work + 4 * grid[1]
    launcher(split_kernel(spec), grid, spec.num_threads, stream)(
        tmp_o, tmp_ml, q, k, v, tables, lens, work, first, tbl_stride, scale_log2(scale))
    launch_reduce(spec, num_seqs, o, tmp_o, tmp_ml, lens, first, stream)


def paged_attention_decode_split(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: float, out: Any | None = None, *, num_parts: int | None = None,
    parts: np.ndarray | None = None,
) -> Any:
    """Split-K decode (validated arguments): `num_parts` partitions of every sequence, or
    `parts[s]` partitions of sequence s (1 .. MAX_PARTS each)."""
    out = output_for(query, out)
    num_seqs = int(query.shape[0])
    if parts is None:
        if num_parts is None or not 1 <= num_parts <= MAX_PARTS:
            raise KernelInputError(f"num_parts must be in [1, {MAX_PARTS}], got {num_parts}")
        parts = np.full(num_seqs, num_parts, np.int32)
    parts = np.asarray(parts, dtype=np.int32)
    if parts.shape != (num_seqs,) or (num_seqs and not 1 <= int(parts.min()) <= int(parts.max()) <= MAX_PARTS):
        raise KernelInputError(f"parts must be [{num_seqs}] counts in [1, {MAX_PARTS}]")
    if num_seqs == 0:
        return out
    spec = attention_spec(query, key_cache, kind_of(out), "split")
    keep: list[Any] = []
    ptrs = attention_ptrs(query, key_cache, value_cache, out)
    tables = index_ptr(block_tables, key_cache, keep)
    lens = index_ptr(seq_lens, key_cache, keep)
    work_list = decode_policy.work_items(parts)
    num_items = int(parts.sum())
    _, scratch_words = split_launch(spec, num_items)
    work = index_ptr(work_list, key_cache, keep)
    scratch = SCRATCH.get(query, scratch_words)
    launch_split(spec, num_seqs, num_items, ptrs, tables, lens, work,
                 int(block_tables.shape[1]), scale, scratch, stream_for(query, key_cache, out))
    return out
