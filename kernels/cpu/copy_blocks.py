"""CPU copy_blocks: copy whole blocks src → dst in every layer, pairs in order.

Parallel over (KV head, token offset) rows of a block, sequential over pairs inside each row:
every row location is independent memory, so this gives exactly the in-order semantics of the
reference (pair i sees what pairs before it wrote) while still using every core — even for an
MQA cache with a single KV head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit, prange

from kernels.cpu import _host


@njit(parallel=True, cache=True)
def _copy_blocks_kernel(cache, block_mapping):
    # cache: [num_blocks, num_kv_heads, block_size, row] uint16 bits (row = head_dim, x2 fp32)
    # block_mapping: [num_pairs, 2] int64 (src, dst)
    num_kv_heads, block_size, row = cache.shape[1], cache.shape[2], cache.shape[3]
    num_pairs = block_mapping.shape[0]
    for item in prange(num_kv_heads * block_size):
        h = item // block_size
        offset = item % block_size
        for p in range(num_pairs):  # in order: later pairs may read earlier pairs' output
            src = block_mapping[p, 0]
            dst = block_mapping[p, 1]
            for d in range(row):
                cache[dst, h, offset, d] = cache[src, h, offset, d]


def copy_blocks(
    key_caches: Sequence[Any], value_caches: Sequence[Any], block_mapping: Any
) -> None:
    """Validated-argument entry point (see `kernels.copy_blocks`)."""
    pairs = _host.index_array(block_mapping, np.int64)
    if pairs.shape[0] == 0:
        return
    for cache in (*key_caches, *value_caches):
        bits, _ = _host.kv_bits(cache)
        _copy_blocks_kernel(bits, pairs)
