"""CPU write_slots: scatter new tokens' K/V rows into their cache slots."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from kernels.cpu import _host


@njit(parallel=True, cache=True)
def _write_slots_kernel(key, value, key_cache, value_cache, slot_mapping):
    # key/value: [num_tokens, num_kv_heads, row] uint16 bits (row = head_dim, x2 for fp32)
    # key_cache/value_cache: [num_blocks, num_kv_heads, block_size, row] uint16 bits
    # slot_mapping: [num_tokens] int64, negative = skip (padding token)
    num_tokens, num_kv_heads, row = key.shape
    block_size = key_cache.shape[2]
    for t in prange(num_tokens):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        block = slot // block_size
        offset = slot % block_size
        for h in range(num_kv_heads):
            for d in range(row):
                key_cache[block, h, offset, d] = key[t, h, d]
                value_cache[block, h, offset, d] = value[t, h, d]


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
    _write_slots_kernel(k, v, kc, vc, slots)
