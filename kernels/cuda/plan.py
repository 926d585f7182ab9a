"""A decode attention launch prepared once and replayed every step (and capturable).

`paged_attention_decode` works out per call what a model's decode step keeps constant: the
kernel variant, the split-K partition count, scratch memory, the launch configurations. A
`DecodePlan` does it once for one batch size and table width; `launch` then reads tensor
addresses and launches. It allocates nothing, reads nothing back from the device and copies
nothing, so a caller may capture it in a CUDA graph (with device-resident tables and lengths:
`DecodeGraphs` in `graph.py` does exactly that, one graph per batch-size bucket).

The partition count cannot depend on the lengths (they change between replays of one graph):
it comes from the batch size, the table capacity and the GPU's real occupancy; each sequence's
partitions are then sized by its own length inside the kernel, so short sequences leave
partitions empty (those blocks exit at once) and a padded row of length 0 yields zeros.
"""

from __future__ import annotations

from typing import Any

from kernels._validate import KernelInputError
from kernels.cuda import decode_split
from kernels.cuda._host import attention_ptrs, scale_log2, spec_for
from kernels.cuda._runtime import device_ptr, kind_of, launcher, stream_for
from kernels.cuda.decode import decode_kernel, resident_blocks
from kernels.cuda.decode_reduce import launch_reduce


class DecodePlan:
    """Decode attention for `batch` sequences of one pool geometry (see the module doc).

    key_cache: any of the pool's caches ([num_blocks, kv_heads, block_size, head_dim]; only
    its geometry, dtype and device are used). `num_parts` forces a partition count (1 =
    one-pass); by default the dispatch rule picks it for a table of `max_blocks_per_seq`.
    """

    def __init__(self, key_cache: Any, num_heads: int, batch: int, max_blocks_per_seq: int,
                 *, q_kind: str | None = None, out_kind: str | None = None,
                 num_parts: int | None = None) -> None:
        _, num_kv_heads, block_size, head_dim = (int(d) for d in key_cache.shape)
        if num_heads % num_kv_heads:
            raise KernelInputError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        kv_kind = kind_of(key_cache)
        self.q_kind = q_kind or kv_kind
        self.out_kind = out_kind or self.q_kind
        group = num_heads // num_kv_heads
        self.spec = spec_for(head_dim, block_size, num_kv_heads, group, self.q_kind, kv_kind,
                             self.out_kind, "decode")
        self.batch, self.num_heads, self.max_blocks = batch, num_heads, max_blocks_per_seq
        self.cache_shape = tuple(int(d) for d in key_cache.shape[1:])
        if num_parts is None:
            base = batch * num_kv_heads * self.spec.row_blocks
            num_parts = decode_split.choose_num_partitions(
                base, max_blocks_per_seq * block_size, resident_blocks(self.spec))
        if not 1 <= num_parts <= decode_split.MAX_PARTS:
            raise KernelInputError(f"num_parts must be in [1, {decode_split.MAX_PARTS}]")
        self.num_parts = num_parts
        self.scratch = None
        if num_parts > 1:
            from kernels.cuda._runtime import empty_like_kind

            self.split_spec = spec_for(head_dim, block_size, num_kv_heads, group, self.q_kind,
                                       kv_kind, self.out_kind, "split")
            rows = batch * num_heads * num_parts
            self.scratch = empty_like_kind(key_cache, (rows * (head_dim + 2),), "float32")
            self._tmp_rows = rows
            decode_split.split_kernel(self.split_spec)  # compile now, not inside a capture
        else:
            decode_kernel(self.spec)

    def check(self, query: Any, key_cache: Any, block_tables: Any, seq_lens: Any,
              out: Any) -> None:
        """The call's arguments match the plan (cheap: shapes and dtypes only)."""
        expected = (self.batch, self.num_heads, self.spec.head_dim)
        if tuple(query.shape) != expected or tuple(out.shape) != expected:
            raise KernelInputError(f"query and out must have shape {expected}")
        if tuple(int(d) for d in key_cache.shape[1:]) != self.cache_shape:
            raise KernelInputError(f"caches must have geometry [*, {self.cache_shape}]")
        if tuple(block_tables.shape) != (self.batch, self.max_blocks):
            raise KernelInputError(f"block_tables must have shape {(self.batch, self.max_blocks)}")
        if tuple(seq_lens.shape) != (self.batch,):
            raise KernelInputError(f"seq_lens must have shape ({self.batch},)")
        if kind_of(query) != self.q_kind or kind_of(out) != self.out_kind:
            raise KernelInputError("query/out dtypes differ from the plan's")

    def launch(self, query: Any, key_cache: Any, value_cache: Any, block_tables: Any,
               seq_lens: Any, scale: float, out: Any) -> Any:
        """Attention into `out` ([batch, num_heads, head_dim]); tables and lengths must be
        device-resident int32 (a padded row may have length 0: its output is zeros)."""
        self.check(query, key_cache, block_tables, seq_lens, out)
        q, k, v, o = attention_ptrs(query, key_cache, value_cache, out)
        tables, lens = device_ptr(block_tables), device_ptr(seq_lens)
        stream = stream_for(query, key_cache, out)
        spec, heads_grid = self.spec, self.spec.num_kv_heads * self.spec.row_blocks
        if self.num_parts == 1:
            launcher(decode_kernel(spec), (heads_grid, self.batch), spec.num_threads, stream)(
                o, q, k, v, tables, lens, self.max_blocks, scale_log2(scale))
            return out
        tmp_o = device_ptr(self.scratch)
        tmp_ml = tmp_o + self._tmp_rows * spec.head_dim * 4
        grid = (heads_grid, self.batch, self.num_parts)
        launcher(decode_split.split_kernel(self.split_spec), grid, spec.num_threads, stream)(
            tmp_o, tmp_ml, q, k, v, tables, lens, self.max_blocks, scale_log2(scale))
        launch_reduce(self.split_spec, self.batch, self.num_parts, o, tmp_o, tmp_ml, lens, stream)
        return out

