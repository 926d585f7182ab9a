"""One step's K/V writes and prefill attention over a `KvPool`, prepared once for every layer.

The pool's `write` and `prefill` go through the public kernel API, which validates its
arguments and works out the launch at every call; a step calls each once per layer with the
same slots, tables, lengths and chunk starts. On the CUDA backend a `StepKernels` binds them
once instead (`kernels/cuda/prefill_plan.py`: `SlotWritePlan`, `PrefillPlan`): the first
layer's call is validated in full, later layers check shapes and launch with pre-bound
arguments. On the CPU backend it calls the pool's methods (their cost there is not Python per
launch). Like `decode_path.py`, this is the pool's own helper: it writes only through the
kernels, into the pool's caches.

    kernels = StepKernels(pool, slot_mapping, PrefillArgs(tables, lens, starts, scale, longest))
    for layer in layers:
        kernels.write(layer, k, v)
        kernels.prefill(layer, q, out)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from compute_node.pool import KvPool


class PrefillArgs(NamedTuple):
    """A step's prefill group: int32 tables `[n, width]`, lengths `[n]`, chunk starts `[n + 1]`
    (on the pool's device), the softmax scale and the longest chunk (a host int)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int


class StepKernels:
    """The writes (and prefill attention, when the step has a prefill group) of one step."""

    def __init__(self, pool: KvPool, slot_mapping: torch.Tensor, prefill: PrefillArgs | None) -> None:
        self.pool, self.slot_mapping, self.prefill_args = pool, slot_mapping, prefill
        self.planned = pool.backend == "cuda"
        self._writes: Any = None
        self._prefill: Any = None
        if self.planned:
            from kernels.cuda.prefill_plan import PrefillPlan, SlotWritePlan  # numba.cuda only here

            self._writes = SlotWritePlan(slot_mapping)
            if prefill is not None:
                self._prefill = PrefillPlan(prefill.block_tables, prefill.seq_lens, prefill.query_start_loc,
                                            prefill.scale, max_query_len=prefill.max_query_len)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new K/V of `layer` at the step's slots."""
        pool = self.pool
        if self._writes is None:
            pool.write(layer, key, value, self.slot_mapping)
            return
        self._writes.write(key, value, pool.key_caches[layer], pool.value_caches[layer])

    def prefill(self, layer: int, query: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill attention of `layer` for the step's prefill group (into `out`, returned)."""
        args = self.prefill_args
        if args is None:   # the caller planned no prefill group: a bug, never a bad request
            raise RuntimeError("this step has no prefill group")
        pool = self.pool
        if self._prefill is None:
            return pool.prefill(layer, query, args.block_tables, args.seq_lens, args.query_start_loc, args.scale,
                                out=out, max_query_len=args.max_query_len)
        out = torch.empty_like(query) if out is None else out
        return self._prefill.attend(query, pool.key_caches[layer], pool.value_caches[layer], out)

