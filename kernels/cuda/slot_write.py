"""write_slots: scatter the K/V of new tokens into their cache slots.

One thread block per token (grid-stride over tokens), threads over the token's
`num_kv_heads * head_dim` elements in 16-byte chunks (8 or 4 bytes when a row is not a
multiple of 16): reads of `key[t]` are contiguous, and writes land in `head_dim`-long
contiguous runs of the cache. Elements are copied as raw bits (bf16 included), so nothing is
rounded. Negative slots (padding) are skipped. Slots are distinct (validated), so no two
threads write one element.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from numba import cuda, int32, int64

from kernels.cuda._host import ADDR, index_ptr
from kernels.cuda._kernel_cache import compile_kernel
from kernels.cuda._ops import ld_s64, ld_u32, ld_v2, ld_v4, st_u32, st_v2, st_v4
from kernels.cuda._runtime import (
    check_aligned,
    device_function,
    device_ptr,
    kind_of,
    launcher,
    max_grid_blocks,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES
from kernels.cuda._stage import chunk_of

THREADS = 128


@cache
def make_copy_chunk(chunk: int) -> Any:
    """Device function: copy `chunk` (16, 8 or 4) bytes between aligned global addresses."""

    @device_function
    def copy(dst: Any, src: Any) -> None:
        if chunk == 16:
            w = ld_v4(src)
            st_v4(dst, w[0], w[1], w[2], w[3])
        elif chunk == 8:
            w = ld_v2(src)
            st_v2(dst, w[0], w[1])
        else:
            st_u32(dst, ld_u32(src))

    return copy


@cache
def build_write_kernel(num_kv_heads: int, block_size: int, head_dim: int, kind: str) -> Any:
    row_bytes = head_dim * KIND_BYTES[kind]
    chunk = chunk_of(row_bytes)
    per_row = row_bytes // chunk
    per_token = num_kv_heads * per_row
    copy = make_copy_chunk(chunk)

    def write_kernel(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any,
                     num_tokens: Any) -> None:
        for t in range(cuda.blockIdx.x, num_tokens, cuda.gridDim.x):
            slot = ld_s64(slots + 8 * t)
            if slot < 0:
                continue  # padding token (uniform for the block)
            block = slot // block_size
            offset = int32(slot - block * block_size)
            for e in range(cuda.threadIdx.x, per_token, cuda.blockDim.x):
                h = int32(e // per_row)
                k = int32(e - h * per_row)
                # key: [num_tokens, num_kv_heads, head_dim]
                src = int64(t) * (num_kv_heads * row_bytes) + int32((h * per_row + k) * chunk)
                # cache: [num_blocks, num_kv_heads, block_size, head_dim]
                dst = (block * num_kv_heads + h) * (block_size * row_bytes) + int32(
                    offset * row_bytes + k * chunk)
                copy(key_cache + dst, key + src)
                copy(value_cache + dst, value + src)

    return write_kernel


WRITE_SIGNATURE = (ADDR, ADDR, ADDR, ADDR, ADDR, ADDR)


@cache
def write_kernel(num_kv_heads: int, block_size: int, head_dim: int, kind: str) -> Any:
    """The compiled kernel of one geometry: JIT once per process, or loaded from the disk cache
    (`_kernel_cache`: keyed by this variant and every kernel source)."""
    return compile_kernel(build_write_kernel(num_kv_heads, block_size, head_dim, kind), WRITE_SIGNATURE,
                          (THREADS, 1), f"write {num_kv_heads} {block_size} {head_dim} {kind}")


def write_slots(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any
) -> None:
    """Scatter K/V into slots on the CUDA backend (arguments already validated)."""
    num_tokens = int(key.shape[0])
    if num_tokens == 0:
        return
    _, num_kv_heads, block_size, head_dim = (int(d) for d in key_cache.shape)
    kind = kind_of(key_cache)
    chunk = chunk_of(head_dim * KIND_BYTES[kind])
    ptrs = [device_ptr(x) for x in (key, value, key_cache, value_cache)]
    for name, ptr in zip(("key", "value", "key_cache", "value_cache"), ptrs):
        check_aligned(name, ptr, chunk)
    keep: list[Any] = []
    slots = index_ptr(slot_mapping, key_cache, keep)
    kernel = write_kernel(num_kv_heads, block_size, head_dim, kind)
    grid = min(num_tokens, max_grid_blocks())
    launcher(kernel, grid, THREADS, stream_for(key, key_cache))(*ptrs, slots, num_tokens)
