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
from numba import prange

from kernels.cpu import _host, _parallel
from kernels.cpu._cache import njit_cached


@njit_cached(inline="always")
def _copy_row(cache, block_mapping, item):
    # cache: [num_blocks, num_kv_heads, block_size, row] uint16 bits (row = head_dim, x2 fp32)
    # block_mapping: [num_pairs, 2] int64 (src, dst)
    block_size = cache.shape[2]
    h = item // block_size
    offset = item % block_size
    for p in range(block_mapping.shape[0]):  # in order: later pairs may read earlier output
        cache[block_mapping[p, 1], h, offset, :] = cache[block_mapping[p, 0], h, offset, :]


@njit_cached(parallel=True)
def _copy_blocks_kernel(cache, block_mapping):
    for item in prange(cache.shape[1] * cache.shape[2]):
        _copy_row(cache, block_mapping, item)


def copy_blocks(
    key_caches: Sequence[Any], value_caches: Sequence[Any], block_mapping: Any
) -> None:
    """Validated-argument entry point (see `kernels.copy_blocks`)."""
    pairs = _host.index_array(block_mapping, np.int64)
    if pairs.shape[0] == 0:
        return
    caches = [_host.kv_bits(cache)[0] for cache in (*key_caches, *value_caches)]
    # A CoW op moves one block (a few KB per layer): one thread, no wake-ups.
    serial = pairs.shape[0] * caches[0][0].nbytes <= _parallel.SERIAL_MAX_COPY_BYTES
    with _parallel.parallel_section(serial, chunk_size=0):
        for bits in caches:
            _copy_blocks_kernel(bits, pairs)
