"""Paged decode attention, one pass: one thread block per (sequence, KV head[, row block]).

The block's rows are the query heads of one GQA group (up to 16; larger groups take several
row blocks), so each K/V byte of the group is read from global memory once. Its warps split
the sequence into interleaved 16-token steps with no barrier in the loop and merge at the end
(`_attention_kernel`). Few long sequences leave SMs idle in this layout: the dispatch rule
(`decode_split.choose_num_partitions`) then routes to the split-K kernel.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from numba import cuda, int64

from kernels.cuda import decode_split
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
from kernels.cuda._runtime import (
    SIMULATOR,
    device_function,
    jit_options,
    kind_of,
    launcher,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES, AttentionSpec


@cache
def build_decode_kernel(spec: AttentionSpec) -> Any:
    """Python kernel function for one variant (compile with cuda.jit or compile_ptx)."""
    head_dim, group, num_heads = spec.head_dim, spec.group_size, spec.num_heads
    rows, row_blocks = spec.rows, spec.row_blocks
    q_row_bytes = head_dim * KIND_BYTES[spec.q_kind]
    out_row_bytes = head_dim * KIND_BYTES[spec.out_kind]

    @device_function
    def row_source(r: Any, q_ptr: Any, seq: Any, kv_head: Any, row0: Any, last: Any,
                   unused: Any) -> Any:
        head_row = row0 + r
        real = r < rows and head_row < group
        # query: [num_seqs, num_heads, head_dim]; head = kv_head * group + head_row
        return q_ptr + (int64(seq) * num_heads + kv_head * group + head_row) * q_row_bytes, real, last

    @device_function
    def row_target(r: Any, out_ptr: Any, seq: Any, kv_head: Any, row0: Any, unused0: Any,
                   unused1: Any) -> Any:
        head_row = row0 + r
        kind = 1 if r < rows and head_row < group else 0
        addr = out_ptr + (int64(seq) * num_heads + kv_head * group + head_row) * out_row_bytes
        return addr, kind, addr

    run = make_block_attention(spec, row_source, row_target)

    def decode_kernel(out_ptr: Any, q_ptr: Any, k_ptr: Any, v_ptr: Any, tbl_ptr: Any,
                      lens_ptr: Any, tbl_stride: Any, scale_log2: Any) -> None:
        kv_head = cuda.blockIdx.x // row_blocks
        row0 = (cuda.blockIdx.x - kv_head * row_blocks) * rows
        seq = cuda.blockIdx.y
        seq_len = ld_s32(lens_ptr + 4 * seq)
        tbl = tbl_ptr + int64(seq) * tbl_stride * 4  # block_tables: [num_seqs, tbl_stride] int32
        run(k_ptr, v_ptr, tbl, kv_head, 0, seq_len, scale_log2,
            q_ptr, seq, kv_head, row0, seq_len - 1, 0, out_ptr, seq, kv_head, row0, 0, 0)

    return decode_kernel


DECODE_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR, ADDR, I32, F32)


@cache
def decode_kernel(spec: AttentionSpec) -> Any:
    return cuda.jit(DECODE_SIGNATURE, **jit_options(launch_bounds(spec)))(build_decode_kernel(spec))


@cache
def resident_blocks(spec: AttentionSpec) -> int:
    """Thread blocks of this variant the whole GPU keeps resident: the occupancy of the
    compiled kernel (registers, shared memory) times the SMs. The split-K kernel shares the
    one-pass kernel's body; it is bounded to 5 blocks per SM where the one-pass kernel has 6
    (`_host.launch_bounds`), so this overstates its occupancy by at most a sixth."""
    if SIMULATOR:
        return 4
    kernel = decode_kernel(spec)
    return int(kernel.overloads[DECODE_SIGNATURE].max_cooperative_grid_blocks(spec.num_threads))


def paged_attention_decode(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: float, out: Any | None = None, *, split: bool | None = None,
) -> Any:
    """Decode attention on the CUDA backend (arguments already validated); returns `out`.

    `split` forces the split-K (True) or one-pass (False) kernel; None applies
    `choose_num_partitions`.
    """
    out = output_for(query, out)
    num_seqs = int(query.shape[0])
    if num_seqs == 0:
        return out
    spec = attention_spec(query, key_cache, kind_of(out), "decode")
    parts = decode_split.partitions_for(spec, num_seqs, block_tables, seq_lens, split,
                                        resident_blocks(spec))
    if parts > 1:
        return decode_split.paged_attention_decode_split(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out, num_parts=parts)
    keep: list[Any] = []
    ptrs = attention_ptrs(query, key_cache, value_cache, out)
    tables = index_ptr(block_tables, key_cache, keep)
    lens = index_ptr(seq_lens, key_cache, keep)
    grid = (spec.num_kv_heads * spec.row_blocks, num_seqs)
    launcher(decode_kernel(spec), grid, spec.num_threads, stream_for(query, key_cache, out))(
        ptrs[3], ptrs[0], ptrs[1], ptrs[2], tables, lens, int(block_tables.shape[1]),
        scale_log2(scale))
    return out
