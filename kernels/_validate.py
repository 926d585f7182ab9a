"""Shared argument validation for the paged-KV kernels.

Every public kernel entry point validates its arguments here before a backend runs, so a bad
call fails with one readable `KernelInputError` instead of an out-of-bounds write inside a
Numba kernel (which would corrupt the page pool silently or crash the process). Validation
never mutates anything: a call that raises has changed no cache.

The checks work on NumPy arrays, torch tensors (CPU or CUDA) and Numba device arrays alike,
because they only read `.shape`, `.dtype` and contiguity. Index *contents* (block ids, slots,
sequence lengths) are checked when the index array lives on the host; reading a device-resident
index array back would cost a device synchronisation per call, so device index arrays get the
shape/dtype checks only and the backend must be given trusted indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

KV_DTYPES = ("float16", "bfloat16", "float32")
QUERY_DTYPES = ("float16", "bfloat16", "float32")


class KernelInputError(ValueError):
    """A kernel was called with arguments it cannot run on (dtype, shape, layout, indices)."""


# ---------------------------------------------------------------------------------------------
# Array introspection that works for numpy, torch and numba device arrays.
# ---------------------------------------------------------------------------------------------


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def is_device_array(x: Any) -> bool:
    """True when `x` lives in GPU memory (a CUDA torch tensor or a Numba device array)."""
    if is_torch(x):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def dtype_name(x: Any) -> str:
    """The element type as a plain name: 'float16', 'bfloat16', 'float32', 'int32', ..."""
    dt = x.dtype
    if is_torch(x):
        return str(dt).removeprefix("torch.")
    return np.dtype(dt).name


def is_contiguous(x: Any) -> bool:
    if is_torch(x):
        return bool(x.is_contiguous())
    if isinstance(x, np.ndarray):
        return bool(x.flags.c_contiguous)
    # Numba device arrays expose `is_c_contiguous()`.
    check = getattr(x, "is_c_contiguous", None)
    return bool(check()) if callable(check) else True


def to_host_numpy(x: Any) -> np.ndarray | None:
    """A zero-copy NumPy view of a host index array, or None when it lives on a device."""
    if is_device_array(x):
        return None
    if is_torch(x):
        return x.detach().numpy()
    return np.asarray(x)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _require_array(name: str, x: Any) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise KernelInputError(f"{name} must be an array or tensor, got {type(x).__name__}")


def require(name: str, x: Any, *, ndim: int, dtypes: Sequence[str]) -> tuple[int, ...]:
    """Check rank, dtype and C-contiguity of one argument; return its shape."""
    _require_array(name, x)
    shape = _shape(x)
    if len(shape) != ndim:
        raise KernelInputError(f"{name} must have {ndim} dimensions, got shape {shape}")
    dt = dtype_name(x)
    if dt not in dtypes:
        raise KernelInputError(f"{name} must have dtype in {tuple(dtypes)}, got {dt}")
    if not is_contiguous(x):
        raise KernelInputError(f"{name} must be C-contiguous")
    return shape


def require_scale(scale: Any) -> float:
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise KernelInputError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value):
        raise KernelInputError(f"scale must be finite, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Per-kernel validation.
# ---------------------------------------------------------------------------------------------


def _check_caches(key_cache: Any, value_cache: Any) -> tuple[int, int, int, int]:
    # [num_blocks, num_kv_heads, block_size, head_dim]
    kshape = require("key_cache", key_cache, ndim=4, dtypes=KV_DTYPES)
    vshape = require("value_cache", value_cache, ndim=4, dtypes=KV_DTYPES)
    if kshape != vshape:
        raise KernelInputError(f"key_cache shape {kshape} != value_cache shape {vshape}")
    if dtype_name(key_cache) != dtype_name(value_cache):
        raise KernelInputError(
            f"key_cache dtype {dtype_name(key_cache)} != value_cache dtype {dtype_name(value_cache)}"
        )
    if min(kshape) < 1:
        raise KernelInputError(f"cache dimensions must all be >= 1, got {kshape}")
    num_blocks, num_kv_heads, block_size, head_dim = kshape   # four: require() checked ndim=4
    return num_blocks, num_kv_heads, block_size, head_dim


def _check_out(out: Any, query: Any, expected_shape: tuple[int, ...]) -> None:
    if out is None:
        return
    shape = require("out", out, ndim=len(expected_shape), dtypes=QUERY_DTYPES)
    if shape != expected_shape:
        raise KernelInputError(f"out must have shape {expected_shape}, got {shape}")
    if is_device_array(out) != is_device_array(query):
        raise KernelInputError("out and query must live on the same device")


def _check_tables(
    block_tables: Any, seq_lens: Any, num_seqs: int, num_blocks: int, block_size: int
) -> np.ndarray | None:
    """Check block tables and sequence lengths; return host seq_lens when available."""
    # [num_seqs, max_blocks_per_seq]
    tshape = require("block_tables", block_tables, ndim=2, dtypes=("int32",))
    lshape = require("seq_lens", seq_lens, ndim=1, dtypes=("int32",))
    if tshape[0] != num_seqs:
        raise KernelInputError(f"block_tables has {tshape[0]} rows for {num_seqs} sequences")
    if lshape != (num_seqs,):
        raise KernelInputError(f"seq_lens must have shape ({num_seqs},), got {lshape}")
    lens = to_host_numpy(seq_lens)
    table = to_host_numpy(block_tables)
    if lens is None or num_seqs == 0:
        return lens
    max_len = tshape[1] * block_size
    if lens.min() < 1 or lens.max() > max_len:
        bad = int(np.flatnonzero((lens < 1) | (lens > max_len))[0])
        raise KernelInputError(
            f"seq_lens[{bad}]={int(lens[bad])} outside [1, {max_len}] "
            f"(max_blocks_per_seq={tshape[1]} x block_size={block_size})"
        )
    if table is not None:
        # Only the blocks a sequence actually uses must be valid: rows are padded past them.
        num_used = (lens.astype(np.int64) + block_size - 1) // block_size
        used = np.arange(tshape[1])[None, :] < num_used[:, None]
        bad_mask = used & ((table < 0) | (table >= num_blocks))
        if bad_mask.any():
            s, i = (int(v) for v in np.argwhere(bad_mask)[0])
            raise KernelInputError(
                f"block_tables[{s}, {i}]={int(table[s, i])} outside [0, {num_blocks})"
            )
    return lens


def check_decode(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    scale: Any, out: Any,
) -> float:
    """Validate `paged_attention_decode` arguments; return the scale as a float."""
    num_blocks, num_kv_heads, block_size, head_dim = _check_caches(key_cache, value_cache)
    # [num_seqs, num_heads, head_dim]
    qshape = require("query", query, ndim=3, dtypes=QUERY_DTYPES)
    num_seqs, num_heads, q_head_dim = qshape
    _check_heads(num_heads, q_head_dim, num_kv_heads, head_dim)
    _check_tables(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    _check_out(out, query, qshape)
    return require_scale(scale)


def check_prefill(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
    query_start_loc: Any, scale: Any, out: Any, max_query_len: Any = None,
) -> float:
    """Validate `paged_prefill_attention` arguments; return the scale as a float."""
    if max_query_len is not None and (
        not isinstance(max_query_len, (int, np.integer)) or isinstance(max_query_len, bool)
        or max_query_len < 0
    ):
        raise KernelInputError(f"max_query_len must be an integer >= 0, got {max_query_len!r}")
    num_blocks, num_kv_heads, block_size, head_dim = _check_caches(key_cache, value_cache)
    # [total_query_tokens, num_heads, head_dim]
    qshape = require("query", query, ndim=3, dtypes=QUERY_DTYPES)
    total_tokens, num_heads, q_head_dim = qshape
    _check_heads(num_heads, q_head_dim, num_kv_heads, head_dim)
    num_seqs = require("block_tables", block_tables, ndim=2, dtypes=("int32",))[0]
    lens = _check_tables(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    # [num_seqs + 1]
    sshape = require("query_start_loc", query_start_loc, ndim=1, dtypes=("int32",))
    if sshape != (num_seqs + 1,):
        raise KernelInputError(
            f"query_start_loc must have shape ({num_seqs + 1},), got {sshape}"
        )
    starts = to_host_numpy(query_start_loc)
    if starts is not None:
        q_lens = np.diff(starts.astype(np.int64))
        if int(starts[0]) != 0 or int(starts[-1]) != total_tokens:
            raise KernelInputError(
                f"query_start_loc must start at 0 and end at {total_tokens} query tokens, "
                f"got {int(starts[0])} … {int(starts[-1])}"
            )
        if (q_lens < 0).any():
            raise KernelInputError("query_start_loc must be non-decreasing")
        if max_query_len is not None and q_lens.size and int(q_lens.max()) > max_query_len:
            raise KernelInputError(
                f"max_query_len {max_query_len} is below the longest chunk ({int(q_lens.max())} "
                "query tokens)")
        if lens is not None and (q_lens > lens).any():
            s = int(np.flatnonzero(q_lens > lens)[0])
            raise KernelInputError(
                f"sequence {s} has {int(q_lens[s])} query tokens but seq_len {int(lens[s])}"
            )
    _check_out(out, query, qshape)
    return require_scale(scale)


def _check_heads(num_heads: int, q_head_dim: int, num_kv_heads: int, head_dim: int) -> None:
    if q_head_dim != head_dim:
        raise KernelInputError(f"query head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
        )


def check_write_slots(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any
) -> None:
    """Validate `write_slots` arguments.

    Duplicate non-negative slots are rejected: parallel writes of one slot would race, and a
    scheduler never legitimately writes two tokens into the same slot in one step.
    """
    num_blocks, num_kv_heads, block_size, head_dim = _check_caches(key_cache, value_cache)
    cache_dtype = dtype_name(key_cache)
    # [num_tokens, num_kv_heads, head_dim]
    kshape = require("key", key, ndim=3, dtypes=(cache_dtype,))
    vshape = require("value", value, ndim=3, dtypes=(cache_dtype,))
    if kshape != vshape:
        raise KernelInputError(f"key shape {kshape} != value shape {vshape}")
    if kshape[1:] != (num_kv_heads, head_dim):
        raise KernelInputError(
            f"key must have shape [num_tokens, {num_kv_heads}, {head_dim}], got {kshape}"
        )
    sshape = require("slot_mapping", slot_mapping, ndim=1, dtypes=("int64",))
    if sshape != (kshape[0],):
        raise KernelInputError(f"slot_mapping must have shape ({kshape[0]},), got {sshape}")
    slots = to_host_numpy(slot_mapping)
    if slots is None or slots.size == 0:
        return
    num_slots = num_blocks * block_size
    if int(slots.max()) >= num_slots:
        bad = int(np.flatnonzero(slots >= num_slots)[0])
        raise KernelInputError(
            f"slot_mapping[{bad}]={int(slots[bad])} >= num_blocks*block_size={num_slots}"
        )
    live = slots[slots >= 0]
    if live.size != np.unique(live).size:
        raise KernelInputError("slot_mapping has duplicate non-negative slots")


def check_copy_blocks(key_caches: Any, value_caches: Any, block_mapping: Any) -> None:
    """Validate `copy_blocks` arguments: per-layer caches of one geometry, pairs in range."""
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        raise KernelInputError("key_caches and value_caches must be lists of per-layer caches")
    if len(key_caches) != len(value_caches):
        raise KernelInputError(
            f"{len(key_caches)} key caches but {len(value_caches)} value caches"
        )
    mshape = require("block_mapping", block_mapping, ndim=2, dtypes=("int64",))
    if mshape[1] != 2:
        raise KernelInputError(f"block_mapping must have shape [num_pairs, 2], got {mshape}")
    if not key_caches:
        return
    first = _check_caches(key_caches[0], value_caches[0])
    first_dtype = dtype_name(key_caches[0])
    first_device = is_device_array(key_caches[0])
    for layer, (kc, vc) in enumerate(zip(key_caches, value_caches)):
        shape = _check_caches(kc, vc)
        if shape != first or dtype_name(kc) != first_dtype:
            raise KernelInputError(
                f"layer {layer} cache {shape}/{dtype_name(kc)} differs from layer 0 "
                f"{first}/{first_dtype}"
            )
        if is_device_array(kc) != first_device or is_device_array(vc) != first_device:
            raise KernelInputError(f"layer {layer} caches live on a different device")
    pairs = to_host_numpy(block_mapping)
    if pairs is not None and pairs.size:
        num_blocks = first[0]
        if int(pairs.min()) < 0 or int(pairs.max()) >= num_blocks:
            r, c = (int(v) for v in np.argwhere((pairs < 0) | (pairs >= num_blocks))[0])
            raise KernelInputError(
                f"block_mapping[{r}, {c}]={int(pairs[r, c])} outside [0, {num_blocks})"
            )
