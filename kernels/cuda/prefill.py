"""Paged prefill attention: query tiles x paged KV, causal.

One thread block per (row tile, KV head, sequence): grid (tiles of the longest chunk,
num_kv_heads, sequences), planned on the host by `plan_prefill_launches` from the longest
chunk's length, which the caller knows (`max_query_len`). Row tiles run in reverse grid.x
order, the longest causal ranges first (`heaviest_first`). Row tiles go in grid.x (up to
2^31 - 1, so a 1M-token prompt at any GQA group fits), KV heads in grid.y and sequences in
grid.z (both <= 65,535): a batch of more sequences is launched in several grids, each with its
first sequence as an argument, so no grid dimension can exceed its CUDA limit.

A sequence's query rows are its query tokens x the heads of one GQA group, row
`qt * group + h`; a row tile is `query_rows_per_cta` consecutive rows, so each staged K/V tile
serves that many rows. Query token j of a sequence sits at absolute position
`seq_len - q_len + j` and sees positions 0 … that position: the cached prefix (through the
block table) plus the causal part of its own chunk; each row masks what it may not see.
Two bodies: the tensor-core path is FA2-class (`_fa2_prefill.py`: 64 rows per block at
head_dim <= 128, warps split the rows, K/V tiles read once per block, double-buffered); the
SIMT path (float32 / mixed types) keeps the shared body (`_attention_kernel.py`: warps split
the positions up to the tile's last visible one and merge at the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, int32, int64

from kernels._validate import KernelInputError, to_host_numpy
from kernels.cuda._attention_kernel import make_block_attention
from kernels.cuda._fa2_prefill import fa2_geometry, make_fa2_prefill
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
from kernels.cuda._kernel_cache import compile_kernel
from kernels.cuda._ops import ld_s32
from kernels.cuda._runtime import device_function, kind_of, launcher, stream_for
from kernels.cuda._spec import KIND_BYTES, AttentionSpec


def query_rows_per_cta(spec: AttentionSpec) -> int:
    """Query rows (query tokens x GQA heads) one thread block holds, each staged K/V tile
    serving all of them: the FA2-class tensor-core kernel's warps x rows per warp (64 at
    head_dim <= 128), the SIMT kernel's `spec.rows`."""
    return fa2_geometry(spec)[1] if spec.path == "tc" else spec.rows


@device_function
def heaviest_first(block_x: Any, grid_x: Any) -> Any:
    """The row tile of block `block_x`: the last (longest causal range) first. Blocks start
    in grid.x order, so the heaviest tiles of each KV head start early and the light ones
    fill the last wave's gaps, instead of the longest tiles starting last and setting the
    tail (a longest-processing-time order, as FlashAttention's LPT scheduler)."""
    return int32(grid_x - 1 - block_x)


@cache
def build_prefill_kernel(spec: AttentionSpec) -> Any:
    head_dim, group, num_heads = spec.head_dim, spec.group_size, spec.num_heads
    rows = query_rows_per_cta(spec)
    fa2 = spec.path == "tc"
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

    if fa2:
        run_fa2 = make_fa2_prefill(spec, row_source, row_target)
    else:
        run = make_block_attention(spec, row_source, row_target)

    def prefill_kernel(out_ptr: Any, q_ptr: Any, k_ptr: Any, v_ptr: Any, tbl_ptr: Any,
                       lens_ptr: Any, starts_ptr: Any, tbl_stride: Any, scale_log2: Any,
                       seq0: Any) -> None:
        row0 = int32(heaviest_first(cuda.blockIdx.x, cuda.gridDim.x) * rows)
        kv_head = cuda.blockIdx.y
        seq = int32(seq0 + cuda.blockIdx.z)
        q_begin = ld_s32(starts_ptr + 4 * seq)
        q_len = int32(ld_s32(starts_ptr + 4 * seq + 4) - q_begin)
        if row0 >= q_len * group:
            return  # a tile past this sequence's rows: uniform for the block, before any barrier
        seq_len = ld_s32(lens_ptr + 4 * seq)
        ctx_begin = int32(seq_len - q_len)  # absolute position of the chunk's first query
        last_qt = min(int32((row0 + rows - 1) // group), int32(q_len - 1))
        tok_end = int32(ctx_begin + last_qt + 1)  # the tile's last visible position + 1
        tbl = tbl_ptr + int64(seq) * tbl_stride * 4  # block_tables: [num_seqs, tbl_stride] int32
        if fa2:
            run_fa2(k_ptr, v_ptr, tbl, kv_head, tok_end, scale_log2,
                    q_ptr, q_begin, q_len, kv_head, row0, ctx_begin,
                    out_ptr, q_begin, q_len, kv_head, row0, 0)
        else:
            run(k_ptr, v_ptr, tbl, kv_head, 0, tok_end, scale_log2,
                q_ptr, q_begin, q_len, kv_head, row0, ctx_begin,
                out_ptr, q_begin, q_len, kv_head, row0, 0)

    return prefill_kernel


PREFILL_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, I32, F32, I32)

MAX_GRID_X = 2**31 - 1  # CUDA's grid limits (every compute capability the kernels build for)
MAX_GRID_YZ = 65_535


@dataclass(slots=True, frozen=True)
class PrefillLaunch:
    """One prefill grid: sequences `seq0 … seq0 + grid[2] - 1`."""

    seq0: int
    grid: tuple[int, int, int]


def plan_prefill_launches(spec: AttentionSpec, num_seqs: int,
                          max_query_len: int) -> list[PrefillLaunch]:
    """The grids of one prefill call, sized from the longest chunk (a host value).

    Raises `KernelInputError` when even this layout cannot launch (more row tiles than grid.x
    holds: ~2^31 x rows / group query tokens in one chunk, or more KV heads than grid.y)."""
    if num_seqs < 0 or max_query_len < 0:
        raise KernelInputError("num_seqs and max_query_len must be >= 0")
    rows = query_rows_per_cta(spec)
    num_tiles = max(1, math.ceil(max_query_len * spec.group_size / rows))
    if num_tiles > MAX_GRID_X or spec.num_kv_heads > MAX_GRID_YZ:
        raise KernelInputError(
            f"a {max_query_len}-token chunk with {spec.num_kv_heads} KV heads x group "
            f"{spec.group_size} needs a ({num_tiles}, {spec.num_kv_heads}) grid, beyond CUDA's "
            f"({MAX_GRID_X}, {MAX_GRID_YZ}): split the prompt into shorter chunks")
    return [PrefillLaunch(seq0, (num_tiles, spec.num_kv_heads, min(MAX_GRID_YZ, num_seqs - seq0)))
            for seq0 in range(0, num_seqs, MAX_GRID_YZ)]


# Resident blocks the FA2-class body promises per SM, by head_dim: 16 warps at 64 (<= 128
# registers), 12 at 128 (<= 168; 128 registers spill 612 bytes) and at 256 (2-warp blocks).
FA2_MIN_BLOCKS = {64: 4, 128: 3, 256: 6}


def prefill_launch_bounds(spec: AttentionSpec) -> tuple[int, int]:
    """(threads, min resident blocks per SM) for the register allocator. The FA2-class body
    promises 12-16 warps per SM (`FA2_MIN_BLOCKS`), which nvJitLink 13.5 meets with 0 spills
    for every shipped variant (bench/kernel_sass.py), where the unbounded build took 194-226
    registers at head_dim >= 128 and held 8 warps, 2 per scheduler, to hide the serial softmax
    chain of a slice. The SIMT body promises its threads only (`_host.launch_bounds`)."""
    if spec.path != "tc":
        return launch_bounds(spec)
    dim = min(d for d in FA2_MIN_BLOCKS if d >= spec.head_dim)
    return spec.num_threads, FA2_MIN_BLOCKS[dim]


@cache
def prefill_kernel(spec: AttentionSpec) -> Any:
    """The kernel of a variant: compiled at its first use in a process (~20 s of JIT), or
    loaded from the disk cache of compiled variants (`_kernel_cache`; its key holds the
    launch bounds, so a change of `FA2_MIN_BLOCKS` builds a new entry)."""
    return compile_kernel(build_prefill_kernel(spec), PREFILL_SIGNATURE,
                          prefill_launch_bounds(spec), f"prefill {spec!r}")


def paged_prefill_attention(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    query_start_loc: Any, scale: float, out: Any | None = None, max_query_len: int | None = None,
) -> Any:
    """Prefill attention on the CUDA backend (arguments already validated); returns `out`.

    `max_query_len` (the longest chunk, >= every sequence's query tokens) sizes the grid; when
    it is not given it comes from `query_start_loc` if that is on the host, else the total
    query tokens is used (always enough; the surplus row tiles exit at once) rather than a
    device-to-host read that would stall the stream."""
    out = output_for(query, out)
    num_seqs = int(block_tables.shape[0])
    total_tokens = int(query.shape[0])
    if num_seqs == 0 or total_tokens == 0:
        return out
    spec = attention_spec(query, key_cache, kind_of(out), "prefill")
    if max_query_len is None:
        starts = to_host_numpy(query_start_loc)
        max_query_len = int(np.diff(starts).max()) if starts is not None else total_tokens
    keep: list[Any] = []
    q, k, v, o = attention_ptrs(query, key_cache, value_cache, out)
    tables = index_ptr(block_tables, key_cache, keep)
    lens = index_ptr(seq_lens, key_cache, keep)
    starts_ptr = index_ptr(query_start_loc, key_cache, keep)
    stream = stream_for(query, key_cache, out)
    kernel = prefill_kernel(spec)
    for launch in plan_prefill_launches(spec, num_seqs, max_query_len):
        launcher(kernel, launch.grid, spec.num_threads, stream)(
            o, q, k, v, tables, lens, starts_ptr, int(block_tables.shape[1]), scale_log2(scale),
            launch.seq0)
    return out
