"""Host-side helpers shared by the attention wrappers: specs from arguments, output buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import types

from kernels._validate import dtype_name
from kernels.cuda._dtypes import NUMBA_STORAGE
from kernels.cuda._runtime import DEFAULT_NUM_THREADS, empty_like_kind, kind_of
from kernels.cuda._spec import DEFAULT_PREFETCH_WINDOW, AttentionSpec, threads_for


def attention_spec(
    query: Any, key_cache: Any, out: Any, *, query_tile: int = 1,
    num_threads: int | None = None, prefetch_window: int | None = None,
) -> AttentionSpec:
    """The kernel variant these (validated) arguments need."""
    _, num_kv_heads, block_size, head_dim = (int(d) for d in key_cache.shape)
    group_size = int(query.shape[1]) // num_kv_heads
    spec = AttentionSpec(
        head_dim=head_dim,
        block_size=block_size,
        group_size=group_size,
        q_kind=kind_of(query),
        kv_kind=kind_of(key_cache),
        out_kind=kind_of(out),
        num_threads=num_threads
        or threads_for(group_size * query_tile, head_dim, DEFAULT_NUM_THREADS),
        prefetch_window=prefetch_window or DEFAULT_PREFETCH_WINDOW,
        query_tile=query_tile,
    )
    spec.check()
    return spec


def output_for(query: Any, out: Any | None) -> Any:
    """`out`, or a new array shaped and typed like `query` on the same device."""
    if out is not None:
        return out
    return empty_like_kind(query, tuple(int(d) for d in query.shape), dtype_name(query))


def array_type(kind: str, ndim: int) -> types.Array:
    """Numba type of a C-contiguous storage array (for compile_ptx signatures)."""
    return types.Array(NUMBA_STORAGE[kind], ndim, "C")


INT32_1D = types.Array(types.int32, 1, "C")
INT32_2D = types.Array(types.int32, 2, "C")
INT64_2D = types.Array(types.int64, 2, "C")
FLOAT32_3D = types.Array(types.float32, 3, "C")
FLOAT32_4D = types.Array(types.float32, 4, "C")


def as_scale(scale: float) -> np.float32:
    """Pass the scale as float32 so the kernel's typing matches the compiled signature."""
    return np.float32(scale)
