"""A step's prefill attention and K/V slot writes, validated once and launched per layer.

Why: `paged_prefill_attention` and `write_slots` validate their arguments and work out the
launch (variant, grids, index addresses — copying host index arrays over) at every call, and a
model step calls each once per layer with the same tables, lengths, chunk starts and slots:
80-145 µs of Python per prefill call and ~50-100 µs per write on an H200 (review
`kernels.md` §1.4), ~4-8 ms per step on a 32-layer model, where the kernels take ~0.1-0.3 ms
per layer. A plan does the per-step part once:

- `PrefillPlan.attend(query, key_cache, value_cache, out)`: the first call runs the public
  API's whole validation (tables and lengths in range when on the host, chunk starts
  consistent, the longest chunk) and binds the step: the variant's kernel, its grids (from
  `max_query_len`), the index arrays' device addresses (host arrays copied once, kept alive
  by the plan). Every later call checks only what can change between layers — shapes,
  dtypes, contiguity of the query and output, the caches' geometry — and launches.
- `SlotWritePlan.write(key, value, key_cache, value_cache)`: the same for `write_slots`
  (slots in range and distinct, checked once on the host copy when there is one).

Neither allocates, copies or reads back anything after its first call, so later calls are
also capturable; what they cannot absorb is a host-sized grid that changes between steps
(the longest chunk), which is why prefill is planned per step and not graphed.

    plan = PrefillPlan(block_tables, seq_lens, query_start_loc, scale, max_query_len=512)
    writes = SlotWritePlan(slot_mapping)
    for layer in range(num_layers):
        writes.write(k[layer], v[layer], key_caches[layer], value_caches[layer])
        plan.attend(q[layer], key_caches[layer], value_caches[layer], out[layer])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels import _validate
from kernels._validate import KernelInputError
from kernels.cuda import prefill, slot_write
from kernels.cuda._host import attention_ptrs, attention_spec, index_ptr, scale_log2
from kernels.cuda._runtime import (
    check_aligned,
    device_ptr,
    kind_of,
    launcher,
    max_grid_blocks,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES
from kernels.cuda._stage import chunk_of


@dataclass(slots=True, frozen=True)
class _Layout:
    """What a later call must share with the first, validated one."""

    shape: tuple[int, ...]
    kind: str
    cache_shape: tuple[int, ...]
    cache_kind: str


def _layout(x: Any, key_cache: Any) -> _Layout:
    return _Layout(tuple(int(d) for d in x.shape), kind_of(x), tuple(int(d) for d in key_cache.shape),
                   kind_of(key_cache))


def _check_same(name: str, bound: _Layout, x: Any, key_cache: Any, value_cache: Any) -> None:
    if _layout(x, key_cache) != bound or tuple(int(d) for d in value_cache.shape) != bound.cache_shape \
            or kind_of(value_cache) != bound.cache_kind:
        raise KernelInputError(f"{name} and the caches must match the plan's first call: {bound}")
    if hasattr(x, "is_contiguous") and not x.is_contiguous():
        raise KernelInputError(f"{name} must be C-contiguous")


class PrefillPlan:
    """Prefill attention of one step, bound at its first call (module doc). `block_tables`
    int32 [num_seqs, width], `seq_lens` int32 [num_seqs], `query_start_loc` int32
    [num_seqs + 1], on the device or the host; `max_query_len`: the longest chunk (a host
    int; without it, taken from host starts, else the total query tokens)."""

    def __init__(self, block_tables: Any, seq_lens: Any, query_start_loc: Any, scale: float, *,
                 max_query_len: int | None = None) -> None:
        self.block_tables, self.seq_lens, self.query_start_loc = block_tables, seq_lens, query_start_loc
        self.scale, self.max_query_len = scale, max_query_len
        self.num_launches = 0
        self._bound: _Layout | None = None
        self._out_kind = ""
        self._keep: list[Any] = []   # device copies of host index arrays, alive for the plan
        self._args: tuple[Any, ...] = ()
        self._launches: list[Any] = []   # (grid, seq0)
        self._kernel: Any = None
        self._threads = 0

    def attend(self, query: Any, key_cache: Any, value_cache: Any, out: Any) -> Any:
        """Attention of this layer's queries `[num_tokens, num_heads, head_dim]` into `out`
        (same shape, the query's or float32 dtype); returns `out`."""
        if self._bound is None:
            self._bind(query, key_cache, value_cache, out)
        else:
            _check_same("query", self._bound, query, key_cache, value_cache)
            if tuple(out.shape) != self._bound.shape or kind_of(out) != self._out_kind:
                raise KernelInputError("out must match the plan's first call")
            if hasattr(out, "is_contiguous") and not out.is_contiguous():
                raise KernelInputError("out must be C-contiguous")
        if not self._launches:
            return out
        q, k, v, o = attention_ptrs(query, key_cache, value_cache, out)
        stream = stream_for(query, key_cache, out)
        for grid, seq0 in self._launches:
            launcher(self._kernel, grid, self._threads, stream)(o, q, k, v, *self._args, seq0)
        self.num_launches += 1
        return out

    def _bind(self, query: Any, key_cache: Any, value_cache: Any, out: Any) -> None:
        self.scale = _validate.check_prefill(query, key_cache, value_cache, self.block_tables, self.seq_lens,
                                             self.query_start_loc, self.scale, out, self.max_query_len)
        num_seqs, total = int(self.block_tables.shape[0]), int(query.shape[0])
        self._bound, self._out_kind = _layout(query, key_cache), kind_of(out)
        if num_seqs == 0 or total == 0:
            return
        spec = attention_spec(query, key_cache, self._out_kind, "prefill")
        longest = self.max_query_len
        if longest is None:
            starts = _validate.to_host_numpy(self.query_start_loc)
            longest = int((starts[1:] - starts[:-1]).max()) if starts is not None else total
        keep = self._keep
        tables = index_ptr(self.block_tables, key_cache, keep)
        lens = index_ptr(self.seq_lens, key_cache, keep)
        starts_ptr = index_ptr(self.query_start_loc, key_cache, keep)
        self._args = (tables, lens, starts_ptr, int(self.block_tables.shape[1]), scale_log2(self.scale))
        self._launches = [(launch.grid, launch.seq0)
                          for launch in prefill.plan_prefill_launches(spec, num_seqs, longest)]
        self._kernel, self._threads = prefill.prefill_kernel(spec), spec.num_threads


class SlotWritePlan:
    """`write_slots` of one step's slots (int64 [num_tokens]; negative: skipped), bound at
    its first call (module doc)."""

    def __init__(self, slot_mapping: Any) -> None:
        self.slot_mapping = slot_mapping
        self.num_launches = 0
        self._bound: _Layout | None = None
        self._keep: list[Any] = []
        self._slots: Any = None
        self._kernel: Any = None
        self._grid = 0
        self._grid_tokens = 0
        self._chunk = 16

    def write(self, key: Any, value: Any, key_cache: Any, value_cache: Any) -> None:
        """Store this layer's new K/V `[num_tokens, num_kv_heads, head_dim]` at the slots."""
        if self._bound is None:
            self._bind(key, value, key_cache, value_cache)
        else:
            _check_same("key", self._bound, key, key_cache, value_cache)
            _check_same("value", self._bound, value, key_cache, value_cache)
        if not self._grid:
            return
        ptrs = [device_ptr(x) for x in (key, value, key_cache, value_cache)]
        for name, ptr in zip(("key", "value", "key_cache", "value_cache"), ptrs, strict=True):
            check_aligned(name, ptr, self._chunk)
        launcher(self._kernel, self._grid, slot_write.THREADS, stream_for(key, key_cache))(
            *ptrs, self._slots, self._grid_tokens)
        self.num_launches += 1

    def _bind(self, key: Any, value: Any, key_cache: Any, value_cache: Any) -> None:
        _validate.check_write_slots(key, value, key_cache, value_cache, self.slot_mapping)
        self._bound = _layout(key, key_cache)
        num_tokens = int(key.shape[0])
        if num_tokens == 0:
            return
        _, num_kv_heads, block_size, head_dim = (int(d) for d in key_cache.shape)
        kind = kind_of(key_cache)
        self._chunk = chunk_of(head_dim * KIND_BYTES[kind])
        self._slots = index_ptr(self.slot_mapping, key_cache, self._keep)
        self._kernel = slot_write.write_kernel(num_kv_heads, block_size, head_dim, kind)
        self._grid = min(num_tokens, max_grid_blocks())
        self._grid_tokens = num_tokens
