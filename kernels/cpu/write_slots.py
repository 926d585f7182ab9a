"""CPU write_slots: scatter new tokens' K/V rows into their cache slots."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import prange

from kernels.cpu import _host, _parallel
from kernels.cpu._cache import njit_cached


@njit_cached(inline="always")
def write_token(key, value, key_cache, value_cache, slot_mapping, t):
    # key/value: [num_tokens, num_kv_heads, row] uint16 bits (row = head_dim, x2 for fp32)
    # key_cache/value_cache: [num_blocks, num_kv_heads, block_size, row] uint16 bits
    slot = slot_mapping[t]
    if slot < 0:  # padding token
        return
    block_size = key_cache.shape[2]
    block = slot // block_size
    offset = slot % block_size
    # Element loops rather than `key_cache[block, h, offset, :] = key[t, h, :]`: the same copy
    # (LLVM vectorises both), without the slice assignment's shape check, whose error message
    # path alone is ~2.5 CPU-s of every cold compile (shapes are validated by the wrapper).
    for h in range(key.shape[1]):
        for d in range(key.shape[2]):
            key_cache[block, h, offset, d] = key[t, h, d]
        for d in range(value.shape[2]):
            value_cache[block, h, offset, d] = value[t, h, d]


@njit_cached(parallel=True)
def _write_slots_kernel(key, value, key_cache, value_cache, slot_mapping):
    for t in prange(key.shape[0]):
        write_token(key, value, key_cache, value_cache, slot_mapping, t)


def write_slots(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any
) -> None:
    """Validated-argument entry point (see `kernels.write_slots`).

    A plain bit copy: key/value have the cache's dtype (validated), so no rounding happens
    here and one compiled signature (uint16 views) serves fp16, bf16 and fp32.
    """
    k, _ = _host.kv_bits(key)
    v, _ = _host.kv_bits(value)
    kc, _ = _host.kv_bits(key_cache)
    vc, _ = _host.kv_bits(value_cache)
    slots = _host.index_array(slot_mapping, np.int64)
    if slots.shape[0] == 0:
        return
    # A decode step writes one token per sequence (tens of KB): one thread, no wake-ups.
    serial = 2 * k.nbytes <= _parallel.SERIAL_MAX_COPY_BYTES
    with _parallel.parallel_section(serial, chunk_size=0):
        _write_slots_kernel(k, v, kc, vc, slots)
