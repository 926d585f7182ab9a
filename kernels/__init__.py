"""Paged-KV kernels: write K/V into slots, copy blocks, paged attention (decode and prefill).

Layouts (per layer):
- caches: `[num_blocks, num_kv_heads, block_size, head_dim]`, the same for K and V;
- `block_tables` int32 `[num_seqs, max_blocks_per_seq]` (entries past a sequence's last block
  are padding and never read); `seq_lens` int32 `[num_seqs]`, the context length including the
  current token(s);
- `slot_mapping` int64 `[num_tokens]`, `block_id * block_size + offset`, negative = skip;
- `block_mapping` int64 `[num_pairs, 2]` of (src, dst), applied in order.

Every entry point validates its arguments (`KernelInputError` on bad input, nothing mutated)
and then dispatches to a backend:
- `"cpu"`: Numba `njit(parallel=True)` kernels in `kernels.cpu` (entry points in `kernels.cpu.api`);
- `"cuda"`: Numba CUDA kernels in `kernels.cuda` (imported lazily so the CPU path never pays
  for, or depends on, numba.cuda);
- `"auto"`: by where the data lives — a CUDA torch tensor or Numba device array selects cuda,
  anything else cpu.

Backends receive the validated arguments unchanged (NumPy arrays or torch tensors, `out`
possibly None) and return the output array; they do their own zero-copy conversion.

On a GPU, decode attention can also be prepared once and replayed: `kernels.DecodePlan` (one
launch, capturable in a CUDA graph) and `kernels.DecodeGraphs` (CUDA graphs per batch-size
bucket and layer); both live in `kernels.cuda` and are imported on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from kernels import _validate
from kernels._validate import KernelInputError, is_device_array

Backend = Literal["auto", "cpu", "cuda"]

__all__ = [
    "Backend",
    "DecodeGraphs",
    "DecodePlan",
    "KernelInputError",
    "copy_blocks",
    "paged_attention_decode",
    "paged_prefill_attention",
    "write_slots",
]


def __getattr__(name: str) -> Any:
    """`DecodePlan` / `DecodeGraphs` from `kernels.cuda`, imported only when asked for (the CPU
    path never loads numba.cuda)."""
    if name == "DecodePlan":
        from kernels.cuda.plan import DecodePlan

        return DecodePlan
    if name == "DecodeGraphs":
        from kernels.cuda.graph import DecodeGraphs

        return DecodeGraphs
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def _backend_module(backend: str, data: Sequence[Any]) -> Any:
    """Resolve `backend` against where `data` (the caches and outputs) lives."""
    on_device = [is_device_array(x) for x in data if x is not None]
    if backend == "auto":
        backend = "cuda" if any(on_device) else "cpu"
    if backend == "cpu":
        if any(on_device):
            raise KernelInputError("backend='cpu' was given GPU-resident arrays")
        from kernels.cpu import api

        return api
    if backend == "cuda":
        from kernels import cuda

        return cuda
    raise KernelInputError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")


def paged_attention_decode(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: float,
    out: Any | None = None,
    backend: Backend = "auto",
    *,
    host_seq_lens: Any = None,
) -> Any:
    """Attention of one query token per sequence over its paged context.

    query/out `[num_seqs, num_heads, head_dim]`; `num_heads` is a multiple of `num_kv_heads`
    (query head h reads KV head `h // (num_heads // num_kv_heads)`). Accumulates in float32;
    the output has the query's dtype unless `out` is given. Returns `out`.

    `host_seq_lens`: the same lengths on the host (integers `[num_seqs]`), when `seq_lens`
    lives on the GPU. The CUDA backend chooses its split-K partitions from them; without
    them it cannot read device lengths (a synchronisation) and takes every sequence at the
    table's capacity. The CPU backend reads `seq_lens` itself and ignores them.
    """
    scale = _validate.check_decode(
        query, key_cache, value_cache, block_tables, seq_lens, scale, out
    )
    module = _backend_module(backend, (query, key_cache, value_cache, out))
    extra: dict[str, Any] = {}
    if host_seq_lens is not None:
        lens = _check_host_seq_lens(host_seq_lens, seq_lens, block_tables, key_cache)
        if module.__name__ == "kernels.cuda":  # the CPU kernels read seq_lens themselves
            extra["host_seq_lens"] = lens
    return module.paged_attention_decode(
        query, key_cache, value_cache, block_tables, seq_lens, scale, out, **extra
    )


def _check_host_seq_lens(host_seq_lens: Any, seq_lens: Any, block_tables: Any,
                         key_cache: Any) -> Any:
    """`host_seq_lens` as int64 NumPy `[num_seqs]`, each in `[1, table capacity]` and equal to
    `seq_lens` where those are on the host too; `KernelInputError` otherwise."""
    import numpy as np

    num_seqs = int(block_tables.shape[0])
    lens = _validate.to_host_numpy(host_seq_lens)
    if lens is None:
        raise KernelInputError("host_seq_lens must be on the host (a device copy is seq_lens)")
    if lens.shape != (num_seqs,) or (num_seqs and lens.dtype.kind not in "iu"):
        raise KernelInputError(
            f"host_seq_lens must be integers of shape ({num_seqs},), got {lens.dtype} {lens.shape}")
    lens = lens.astype(np.int64)
    capacity = int(block_tables.shape[1]) * int(key_cache.shape[2])
    if num_seqs and (lens.min() < 1 or lens.max() > capacity):
        raise KernelInputError(f"host_seq_lens outside [1, {capacity}] (the tables' capacity)")
    device = _validate.to_host_numpy(seq_lens)
    if device is not None and not np.array_equal(device, lens):
        raise KernelInputError("host_seq_lens differ from seq_lens")
    return lens


def paged_prefill_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
    out: Any | None = None,
    backend: Backend = "auto",
    max_query_len: int | None = None,
) -> Any:
    """Causal attention of many query tokens per sequence over the paged prefix + themselves.

    query/out `[total_query_tokens, num_heads, head_dim]`; sequence s owns query rows
    `query_start_loc[s] … query_start_loc[s+1]-1`, its j-th token at absolute position
    `seq_len - q_len + j`, attending to positions `0 … seq_len - q_len + j`. The new tokens'
    K/V must already be in the cache (`write_slots` first). Returns `out`.

    `max_query_len`: the longest chunk (host int, >= every sequence's query tokens). The CUDA
    backend sizes its grid from it; pass it when `query_start_loc` lives on the GPU (the
    caller built it on the host), else the grid is sized from the total query tokens.
    """
    scale = _validate.check_prefill(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
        max_query_len,
    )
    module = _backend_module(backend, (query, key_cache, value_cache, out))
    if module.__name__ == "kernels.cuda":
        return module.paged_prefill_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
            max_query_len=max_query_len,
        )
    return module.paged_prefill_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out
    )


def write_slots(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    backend: Backend = "auto",
) -> None:
    """Store new tokens' K/V (`[num_tokens, num_kv_heads, head_dim]`, the cache's dtype) at
    their slots; negative slots are skipped, duplicate non-negative slots are rejected."""
    _validate.check_write_slots(key, value, key_cache, value_cache, slot_mapping)
    module = _backend_module(backend, (key, value, key_cache, value_cache))
    module.write_slots(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: Sequence[Any],
    value_caches: Sequence[Any],
    block_mapping: Any,
    backend: Backend = "auto",
) -> None:
    """Copy blocks src → dst in every layer's K and V cache.

    Pairs apply in order with sequential semantics: a pair sees what earlier pairs wrote (e.g.
    a defrag move A→B followed by a CoW B→C copies A's original bytes into C).
    """
    _validate.check_copy_blocks(key_caches, value_caches, block_mapping)
    module = _backend_module(backend, (*key_caches, *value_caches))
    module.copy_blocks(key_caches, value_caches, block_mapping)
