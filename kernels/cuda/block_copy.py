"""copy_blocks: copy whole blocks src → dst in every layer's K and V cache, in pair order.

Semantics (same as `kernels.reference.copy_blocks`): pairs apply sequentially — pair i sees
the result of pairs 0 … i-1 — because the compute node applies CoW and defrag ops in op order
and a later op may read a block an earlier op wrote. A parallel kernel cannot honour that for
dependent pairs, so the host first groups pairs into *waves* (`plan_waves`): a pair goes to the
first wave after every earlier pair it conflicts with (reads what it writes, writes what it
reads or writes). Pairs within one wave touch disjoint blocks and run in parallel; waves run
one after the other on the same stream. The usual batch (CoW copies into fresh blocks) is a
single wave.

All layers go in one launch per wave: a small device table holds every layer's K and V
address (built once per set of pools and memoised), grid axis y indexes the layer, and blocks
move in 16-byte chunks.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from numba import cuda

from kernels._validate import KernelInputError, is_device_array, is_torch
from kernels.cuda._host import ADDR, index_ptr
from kernels.cuda._kernel_cache import compile_kernel
from kernels.cuda._ops import ld_s64
from kernels.cuda._runtime import (
    SIMULATOR,
    device_ptr,
    kind_of,
    launcher,
    max_grid_blocks,
    stream_for,
)
from kernels.cuda._spec import KIND_BYTES
from kernels.cuda._stage import chunk_of
from kernels.cuda.slot_write import THREADS, make_copy_chunk


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
    for members in waves:
        bounds.append((begin, begin + len(members)))
        begin += len(members)
    ordered = np.ascontiguousarray(pairs[order], dtype=np.int64).reshape(-1, 2)
    return ordered, bounds


@cache
def build_copy_kernel(num_kv_heads: int, block_size: int, head_dim: int, kind: str) -> Any:
    block_bytes = num_kv_heads * block_size * head_dim * KIND_BYTES[kind]
    chunk = chunk_of(block_bytes)
    chunks = block_bytes // chunk
    copy = make_copy_chunk(chunk)

    def copy_kernel(caches: Any, pairs: Any, begin: Any, end: Any) -> None:
        # caches: [2 * num_layers] int64 addresses, K of every layer then V; grid y = layer
        layer = cuda.blockIdx.y
        kc = ld_s64(caches + 16 * layer)
        vc = ld_s64(caches + 16 * layer + 8)
        for i in range(begin + cuda.blockIdx.x, end, cuda.gridDim.x):
            # pairs: [num_pairs, 2] int64 (src, dst); a block is [kv_heads, block, dim]
            src = ld_s64(pairs + 16 * i) * block_bytes
            dst = ld_s64(pairs + 16 * i + 8) * block_bytes
            for e in range(cuda.threadIdx.x, chunks, cuda.blockDim.x):
                copy(kc + dst + e * chunk, kc + src + e * chunk)
                copy(vc + dst + e * chunk, vc + src + e * chunk)

    return copy_kernel


COPY_SIGNATURE = (ADDR, ADDR, ADDR, ADDR)


@cache
def copy_kernel(num_kv_heads: int, block_size: int, head_dim: int, kind: str) -> Any:
    """The compiled kernel of one geometry: JIT once per process, or loaded from the disk cache
    (`_kernel_cache`: keyed by this variant and every kernel source)."""
    return compile_kernel(build_copy_kernel(num_kv_heads, block_size, head_dim, kind), COPY_SIGNATURE,
                          (THREADS, 1), f"copy {num_kv_heads} {block_size} {head_dim} {kind}")


def _host_pairs(block_mapping: Any) -> np.ndarray:
    """The pairs on the host: wave planning needs them (one small read if device-resident)."""
    if is_torch(block_mapping):
        return block_mapping.detach().cpu().numpy().reshape(-1, 2)
    if is_device_array(block_mapping) and not SIMULATOR:
        return cuda.as_cuda_array(block_mapping).copy_to_host().reshape(-1, 2)
    return np.asarray(block_mapping).reshape(-1, 2)


_LAYER_TABLES: dict[tuple[Any, ...], Any] = {}  # cache addresses → their device copy


def _layer_table(key_caches: Any, value_caches: Any, like: Any) -> Any:
    """Address of a device table of every layer's K and V address (memoised: pools live for
    the process). Under the simulator, a table object whose entries are the `SimPtr`s."""
    ptrs = []
    for kc, vc in zip(key_caches, value_caches):
        ptrs += [device_ptr(kc), device_ptr(vc)]
    if SIMULATOR:
        from kernels.cuda._ops_sim import SimPtrTable

        return SimPtrTable(ptrs)
    key = tuple(ptrs)
    table = _LAYER_TABLES.get(key)
    if table is None:
        host = np.array(ptrs, dtype=np.int64)
        if is_torch(like):
            import torch

            table = torch.from_numpy(host).to(like.device)
        else:
            table = cuda.to_device(host)
        if len(_LAYER_TABLES) > 64:
            _LAYER_TABLES.clear()
        _LAYER_TABLES[key] = table
    return device_ptr(table)


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
    kernel = copy_kernel(num_kv_heads, block_size, head_dim, kinds.pop())
    keep: list[Any] = []
    pairs = index_ptr(ordered, first, keep)
    stream = stream_for(first)
    num_layers = len(key_caches)
    table = _layer_table(key_caches, value_caches, first)
    for begin, end in bounds:
        grid_x = min(end - begin, max(1, max_grid_blocks() // num_layers))
        launcher(kernel, (grid_x, num_layers), THREADS, stream)(table, pairs, begin, end)
