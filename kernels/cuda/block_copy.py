"""copy_blocks: copy whole blocks src → dst in every layer's K and V cache, in pair order.

Semantics (same as `kernels.reference.copy_blocks`): pairs apply sequentially — pair i sees
the result of pairs 0 … i-1 — because the compute node applies CoW and defrag ops in op order
and a later op may read a block an earlier op wrote. A parallel kernel cannot honour that for
dependent pairs, so the host first groups pairs into *waves* (`plan_waves`): a pair goes to the
first wave after every earlier pair it conflicts with (reads what it writes, writes what it
reads or writes). Pairs within one wave touch disjoint blocks and run in parallel; waves run
one after the other on the same stream. The usual batch (CoW copies into fresh blocks) is a
single wave.

All layers go in one launch per wave: the per-layer caches are passed as tuples (Numba
specialises the kernel on the layer count) and grid axis y indexes the layer.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from numba import cuda, types

from kernels._validate import KernelInputError, is_device_array, is_torch
from kernels.cuda._dtypes import NUMBA_STORAGE
from kernels.cuda._runtime import (
    DEFAULT_NUM_THREADS, SIMULATOR, jit_options, kind_of, max_grid_blocks, stream_for,
    to_kernel_array, to_kernel_index,
)


def plan_waves(pairs: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Reorder pairs into conflict-free waves; return (ordered pairs, [(begin, end)] per wave).

    A pair with src == dst is a no-op and dropped. O(num_pairs) with dicts of the last wave
    that wrote / read each block.
    """
    last_write: dict[int, int] = {}
    last_read: dict[int, int] = {}
    waves: list[list[int]] = []
    for i in range(pairs.shape[0]):
        src, dst = int(pairs[i, 0]), int(pairs[i, 1])
        if src == dst:
            continue
        wave = max(last_write.get(src, -1), last_write.get(dst, -1), last_read.get(dst, -1)) + 1
        last_write[dst] = wave
        last_read[src] = max(last_read.get(src, -1), wave)
        if wave == len(waves):
            waves.append([])
        waves[wave].append(i)
    order = [i for wave in waves for i in wave]
    bounds: list[tuple[int, int]] = []
    begin = 0
    for wave in waves:
        bounds.append((begin, begin + len(wave)))
        begin += len(wave)
    ordered = np.ascontiguousarray(pairs[order], dtype=np.int64).reshape(-1, 2)
    return ordered, bounds


@cache
def build_copy_kernel(num_kv_heads: int, block_size: int, head_dim: int) -> Any:
    block_elems = num_kv_heads * block_size * head_dim
    per_head = block_size * head_dim

    def copy_kernel(key_caches: Any, value_caches: Any, pairs: Any, begin: Any, end: Any) -> None:
        layer = cuda.blockIdx.y
        kc = key_caches[layer]  # [num_blocks, num_kv_heads, block_size, head_dim]
        vc = value_caches[layer]
        for i in range(begin + cuda.blockIdx.x, end, cuda.gridDim.x):
            src = pairs[i, 0]
            dst = pairs[i, 1]
            for e in range(cuda.threadIdx.x, block_elems, cuda.blockDim.x):
                h = e // per_head
                rest = e - h * per_head
                t = rest // head_dim
                d = rest - t * head_dim
                kc[dst, h, t, d] = kc[src, h, t, d]
                vc[dst, h, t, d] = vc[src, h, t, d]

    return copy_kernel


def copy_signature(kind: str, num_layers: int) -> tuple[Any, ...]:
    layers = types.UniTuple(types.Array(NUMBA_STORAGE[kind], 4, "C"), num_layers)
    return (layers, layers, types.Array(types.int64, 2, "C"), types.int64, types.int64)


@cache
def copy_kernel(num_kv_heads: int, block_size: int, head_dim: int) -> Any:
    return cuda.jit(**jit_options())(build_copy_kernel(num_kv_heads, block_size, head_dim))


def _host_pairs(block_mapping: Any) -> np.ndarray:
    """The pairs on the host: wave planning needs them (one small read if device-resident)."""
    if is_torch(block_mapping):
        return block_mapping.detach().cpu().numpy().reshape(-1, 2)
    if is_device_array(block_mapping) and not SIMULATOR:
        return cuda.as_cuda_array(block_mapping).copy_to_host().reshape(-1, 2)
    return np.asarray(block_mapping).reshape(-1, 2)


def copy_blocks(key_caches: Any, value_caches: Any, block_mapping: Any) -> None:
    """Copy blocks in every layer on the CUDA backend (arguments already validated)."""
    if not key_caches or int(block_mapping.shape[0]) == 0:
        return
    first = key_caches[0]
    kinds = {kind_of(c) for c in (*key_caches, *value_caches)}
    if len(kinds) != 1:
        raise KernelInputError(f"key and value caches must share one dtype, got {sorted(kinds)}")
    ordered, bounds = plan_waves(_host_pairs(block_mapping))
    if not bounds:
        return
    _, num_kv_heads, block_size, head_dim = (int(d) for d in first.shape)
    kernel = copy_kernel(num_kv_heads, block_size, head_dim)
    keys = tuple(to_kernel_array(c, cache_view=True) for c in key_caches)
    values = tuple(to_kernel_array(c, cache_view=True) for c in value_caches)
    pairs = to_kernel_index(ordered, first)
    threads = DEFAULT_NUM_THREADS
    stream = stream_for(first)
    for begin, end in bounds:
        grid_x = min(end - begin, max(1, max_grid_blocks() // len(keys)))
        kernel[(grid_x, len(keys)), threads, stream](keys, values, pairs, begin, end)
