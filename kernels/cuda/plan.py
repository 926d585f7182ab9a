"""A decode attention launch prepared once and replayed every step (and capturable).

`paged_attention_decode` works out per call what a model's decode step keeps constant: the
kernel variant, the split-K partitioning, scratch memory, the launch configurations. A
`DecodePlan` does it once for one batch size and table width; `launch` then reads tensor
addresses and launches. It allocates nothing, reads nothing back from the device and copies
nothing, so a caller may capture it in a CUDA graph (with device-resident tables and lengths:
`DecodeGraphs` in `graph.py` does exactly that, one graph per batch-size bucket and kernel).

A plan holds both kernels. Its split-K launch runs over a device work list (`decode_policy.
work_items`) whose grid is fixed at `max_items` work items — the plan's worst case
(`decode_policy.graph_items`): the design point (every row at the table capacity) or the
batch plus one more wave of the split kernel. What changes between replays is only the list's
contents:
- by default (`schedule(None)`), the design point's partitioning: every sequence cut into
  `num_parts` partitions sized by its own length inside the kernel (short sequences leave
  partitions empty: those blocks exit at once), which needs no lengths on the host;
- `schedule(host_lens)` applies the policy to this step's lengths (a common chunk size: a
  long sequence gets more partitions than its short neighbours) and copies the new list in
  (stream-ordered, before the next launch); it returns whether the step should run split-K.
Unused items of the fixed grid exit at once; a padded row of length 0 yields zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels._validate import KernelInputError, is_torch
from kernels.cuda import decode, decode_policy, decode_split
from kernels.cuda._host import attention_ptrs, scale_log2, spec_for
from kernels.cuda._runtime import SIMULATOR, device_ptr, empty_like_kind, kind_of, launcher, stream_for


class DecodePlan:
    """Decode attention for `batch` sequences of one pool geometry (see the module doc).

    key_cache: any of the pool's caches ([num_blocks, kv_heads, block_size, head_dim]; only
    its geometry, dtype and device are used). `num_parts` forces a partition count for every
    sequence (1 = one-pass only); by default the policy picks the design point's for a table
    of `max_blocks_per_seq`, and `schedule` may re-partition per step.
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
        self.split_spec = decode.split_spec(self.spec)
        self.batch, self.num_heads, self.max_blocks = batch, num_heads, max_blocks_per_seq
        self.cache_shape = tuple(int(d) for d in key_cache.shape[1:])
        self.heads_grid = num_kv_heads * self.spec.row_blocks
        self.forced = num_parts is not None
        capacity = max_blocks_per_seq * block_size
        self.occupancy: decode_policy.Occupancy | None = None
        if num_parts is None:
            self.occupancy = decode.resident_blocks(self.spec)
            num_parts = decode_policy.uniform_parts(batch, capacity, self.heads_grid,
                                                    self.occupancy)
            self.max_items = decode_policy.graph_items(batch, capacity, self.heads_grid,
                                                       self.occupancy)
        else:
            if not 1 <= num_parts <= decode_policy.MAX_PARTS:
                raise KernelInputError(f"num_parts must be in [1, {decode_policy.MAX_PARTS}]")
            self.max_items = batch * num_parts if num_parts > 1 else 0
        self.num_parts = num_parts  # the design point's (1 = one pass)
        self.split = num_parts > 1  # whether launches run split-K (until `schedule`)
        self.parts: np.ndarray | None = None  # this step's partitions per sequence, if split
        self.scratch: Any = None
        self.work: Any = None
        if self.max_items:
            _, words = decode_split.split_launch(self.split_spec, self.max_items)
            self.scratch = empty_like_kind(key_cache, (words,), "float32")
            self.work = self._device_int32(key_cache, self._design_work())
            decode_split.split_kernel(self.split_spec)  # compile now, not inside a capture
        decode.decode_kernel(self.spec)

    def _design_work(self) -> np.ndarray:
        parts = np.full(self.batch, max(1, self.num_parts), np.int32)
        return decode_policy.work_items(parts, self.max_items)

    @staticmethod
    def _device_int32(like: Any, values: np.ndarray) -> Any:
        if is_torch(like):  # a CUDA tensor; a CPU one under the simulator
            import torch

            return torch.from_numpy(values).to(like.device)
        if SIMULATOR:
            return values.copy()
        from numba import cuda

        return cuda.to_device(values)

    def _load_work(self, work: np.ndarray) -> None:
        """Copy a work list in, ordered on the current stream before the next launch."""
        if not is_torch(self.work):
            if SIMULATOR:
                self.work[:] = work
            else:
                self.work.copy_to_device(work)
            return
        import torch

        host = torch.from_numpy(work)
        if self.work.is_cuda:  # pinned: an asynchronous copy, safe to reuse `work` after
            host = host.pin_memory()
        self.work.copy_(host, non_blocking=self.work.is_cuda)

    def schedule(self, seq_lens: Any | None) -> bool:
        """Partition this step's batch and load the work list (host lengths, [batch] int32,
        0 for padded rows), or restore the design point's (None: lengths unknown on the
        host). Returns whether launches now run split-K. Forced plans keep their count."""
        if self.forced or self.occupancy is None or not self.max_items:
            return self.split
        if seq_lens is None:
            parts, work = None, self._design_work()
            self.split = self.num_parts > 1
        else:
            lens = np.asarray(seq_lens, dtype=np.int64)
            if lens.shape != (self.batch,):
                raise KernelInputError(f"seq_lens must have shape ({self.batch},)")
            parts = decode_policy.split_parts(lens, self.heads_grid, self.occupancy,
                                              self.max_items)
            self.split = parts is not None
            if parts is None:
                return False
            work = decode_policy.work_items(parts, self.max_items)
        self.parts = parts
        self._load_work(work)
        return self.split

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
               seq_lens: Any, scale: float, out: Any, *, split: bool | None = None) -> Any:
        """Attention into `out` ([batch, num_heads, head_dim]); tables and lengths must be
        device-resident int32 (a padded row may have length 0: its output is zeros).
        `split`: which kernel (default: the current schedule's)."""
        self.check(query, key_cache, block_tables, seq_lens, out)
        split = self.split if split is None else split
        if split and not self.max_items:
            raise KernelInputError("this plan was built one-pass only (num_parts=1)")
        ptrs = attention_ptrs(query, key_cache, value_cache, out)
        tables, lens = device_ptr(block_tables), device_ptr(seq_lens)
        stream = stream_for(query, key_cache, out)
        if not split:
            q, k, v, o = ptrs
            launcher(decode.decode_kernel(self.spec), (self.heads_grid, self.batch),
                     self.spec.num_threads, stream)(
                o, q, k, v, tables, lens, self.max_blocks, scale_log2(scale))
            return out
        decode_split.launch_split(self.split_spec, self.batch, self.max_items, ptrs, tables,
                                  lens, device_ptr(self.work), self.max_blocks, scale,
                                  self.scratch, stream)
        return out
