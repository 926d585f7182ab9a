"""Paged decode attention, one pass: one thread block per (sequence, KV head[, row block]).

The block's rows are the query heads of one GQA group (up to 16; larger groups take several
row blocks), so each K/V byte of the group is read from global memory once. Its warps split
the sequence into interleaved 16-token steps with no barrier in the loop and merge at the end
(`_attention_kernel`). Few long sequences leave SMs idle in this layout: the dispatch rule
(`decode_policy.split_parts`) then routes to the split-K kernel, judging each kernel by its
own resident blocks (`resident_blocks`).
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
    spec_for,
)
from kernels.cuda._kernel_cache import compile_kernel
from kernels.cuda._ops import ld_s32
from kernels.cuda._runtime import (
    SIMULATOR,
    device_function,
    kind_of,
    launcher,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES, AttentionSpec
from kernels.cuda.decode_policy import Occupancy


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
    """The one-pass kernel of a variant: compiled at its first use in a process, or loaded
    from the disk cache of compiled variants (`_kernel_cache`: ~5-17 s of JIT each)."""
    return compile_kernel(build_decode_kernel(spec), DECODE_SIGNATURE, launch_bounds(spec),
                          f"decode {spec!r}")


def split_spec(spec: AttentionSpec) -> AttentionSpec:
    """The split-K variant of a decode variant (same geometry and dtypes)."""
    return spec_for(spec.head_dim, spec.block_size, spec.num_kv_heads, spec.group_size,
                    spec.q_kind, spec.kv_kind, spec.out_kind, "split")


SIM_RESIDENT_BLOCKS = 4  # the simulator's pretend GPU: one SM holding 4 blocks


def kernel_resident_blocks(kernel: Any, signature: tuple[Any, ...], threads: int) -> int:
    """Blocks of one compiled kernel the whole GPU keeps resident: its occupancy per SM
    (registers, shared memory, as the driver computes it) times the SMs."""
    if SIMULATOR:
        return SIM_RESIDENT_BLOCKS
    return int(kernel.overloads[signature].max_cooperative_grid_blocks(threads))


@cache
def resident_blocks(spec: AttentionSpec) -> Occupancy:
    """Resident blocks of each decode kernel of this variant, each from the kernel that
    launches: the one-pass kernel (6 blocks per SM on sm_90 for the tensor-core variants at
    head_dim <= 128) and the split-K kernel (5: it needs ~95 registers). Counting the split
    grid against the one-pass figure overfilled it by a tail wave (issue 43);
    tests/kernels/test_decode_policy.py fails if either field comes from the other kernel."""
    split = split_spec(spec)
    return Occupancy(
        one_pass=kernel_resident_blocks(decode_kernel(spec), DECODE_SIGNATURE, spec.num_threads),
        split=kernel_resident_blocks(decode_split.split_kernel(split),
                                     decode_split.SPLIT_SIGNATURE, split.num_threads))


def paged_attention_decode(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: float, out: Any | None = None, *, split: bool | None = None,
    host_seq_lens: Any = None,
) -> Any:
    """Decode attention on the CUDA backend (arguments already validated); returns `out`.

    `split` forces the split-K (True) or one-pass (False) kernel; None applies the policy
    (`decode_policy.split_parts`), on `host_seq_lens` (validated, `[num_seqs]`) when given,
    else on `seq_lens` when they are on the host, else at the tables' capacity.
    """
    out = output_for(query, out)
    num_seqs = int(query.shape[0])
    if num_seqs == 0:
        return out
    spec = attention_spec(query, key_cache, kind_of(out), "decode")
    policy_lens = seq_lens if host_seq_lens is None else host_seq_lens
    parts = decode_split.parts_for(spec, num_seqs, block_tables, policy_lens, split,
                                   resident_blocks(spec) if split is None else None)
    if parts is not None:
        return decode_split.paged_attention_decode_split(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out, parts=parts)
    keep: list[Any] = []
    ptrs = attention_ptrs(query, key_cache, value_cache, out)
    tables = index_ptr(block_tables, key_cache, keep)
    lens = index_ptr(seq_lens, key_cache, keep)
    grid = (spec.num_kv_heads * spec.row_blocks, num_seqs)
    launcher(decode_kernel(spec), grid, spec.num_threads, stream_for(query, key_cache, out))(
        ptrs[3], ptrs[0], ptrs[1], ptrs[2], tables, lens, int(block_tables.shape[1]),
        scale_log2(scale))
    return out
