"""write_slots: scatter the K/V of new tokens into their cache slots.

One thread block per token (grid-stride over tokens), threads over the token's
`num_kv_heads * head_dim` elements: reads of `key[t]` are contiguous, and writes land in
`head_dim`-long contiguous runs of the cache. Elements are copied as raw storage values
(bf16 as its int16 bits), so nothing is rounded. Negative slots (padding) are skipped.
Slots are distinct (validated), so no two threads write one element.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from numba import cuda, types

from kernels.cuda._dtypes import NUMBA_STORAGE
from kernels.cuda._runtime import (
    DEFAULT_NUM_THREADS, jit_options, max_grid_blocks, stream_for, to_kernel_array,
    to_kernel_index,
)


@cache
def build_write_kernel(num_kv_heads: int, block_size: int, head_dim: int) -> Any:
    elems = num_kv_heads * head_dim

    def write_kernel(key: Any, value: Any, key_cache: Any, value_cache: Any,
                     slot_mapping: Any) -> None:
        for t in range(cuda.blockIdx.x, slot_mapping.shape[0], cuda.gridDim.x):
            slot = slot_mapping[t]
            if slot < 0:
                continue  # padding token
            block = slot // block_size
            offset = slot - block * block_size
            for e in range(cuda.threadIdx.x, elems, cuda.blockDim.x):
                h = e // head_dim
                d = e - h * head_dim
                # key: [num_tokens, num_kv_heads, head_dim]
                # key_cache: [num_blocks, num_kv_heads, block_size, head_dim]
                key_cache[block, h, offset, d] = key[t, h, d]
                value_cache[block, h, offset, d] = value[t, h, d]

    return write_kernel


def write_signature(kind: str) -> tuple[Any, ...]:
    tokens = types.Array(NUMBA_STORAGE[kind], 3, "C")
    cache_t = types.Array(NUMBA_STORAGE[kind], 4, "C")
    return (tokens, tokens, cache_t, cache_t, types.Array(types.int64, 1, "C"))


@cache
def write_kernel(num_kv_heads: int, block_size: int, head_dim: int) -> Any:
    return cuda.jit(**jit_options())(build_write_kernel(num_kv_heads, block_size, head_dim))


def write_slots(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any
) -> None:
    """Scatter K/V into slots on the CUDA backend (arguments already validated)."""
    num_tokens = int(key.shape[0])
    if num_tokens == 0:
        return
    _, num_kv_heads, block_size, head_dim = (int(d) for d in key_cache.shape)
    kernel = write_kernel(num_kv_heads, block_size, head_dim)
    grid = min(num_tokens, max_grid_blocks())
    threads = min(DEFAULT_NUM_THREADS, max(32, num_kv_heads * head_dim))
    stream = stream_for(key, key_cache)
    kernel[grid, threads, stream](
        to_kernel_array(key), to_kernel_array(value),
        to_kernel_array(key_cache, cache_view=True), to_kernel_array(value_cache, cache_view=True),
        to_kernel_index(slot_mapping, key_cache),
    )
