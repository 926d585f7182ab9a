"""A million-token sequence for the CPU decode: inputs and a float64 reference that fit memory.

62,500 blocks of 16 tokens, 1 KV head, head dim 64, fp16 (128 MB of K and 128 MB of V), in a
shuffled block table. The float64 reference walks the context in chunks (the whole context in
float64 would be 1 GB per cache). Shared by the --slow test
(tests/kernels/test_million_tokens.py) and bench/bench_million.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MILLION = 1_000_000
BLOCK_SIZE = 16
NUM_BLOCKS = MILLION // BLOCK_SIZE  # 62,500
HEAD_DIM = 64
GROUP = 4  # query heads sharing the one KV head
REF_CHUNK = 1 << 16


@dataclass(slots=True)
class MillionCase:
    key_cache: np.ndarray    # fp16 [NUM_BLOCKS, 1, BLOCK_SIZE, HEAD_DIM]
    value_cache: np.ndarray
    table: np.ndarray        # int32 [NUM_BLOCKS]: logical block -> block id (shuffled)
    scale: float

    @property
    def kv_bytes(self) -> int:
        return self.key_cache.nbytes + self.value_cache.nbytes


def make_million_case(seed: int = 0) -> MillionCase:
    rng = np.random.default_rng(seed)
    shape = (NUM_BLOCKS, 1, BLOCK_SIZE, HEAD_DIM)
    key_cache = rng.standard_normal(shape, np.float32).astype(np.float16)
    value_cache = rng.standard_normal(shape, np.float32).astype(np.float16)
    table = rng.permutation(NUM_BLOCKS).astype(np.int32)
    return MillionCase(key_cache, value_cache, table, 1.0 / np.sqrt(HEAD_DIM))


def reference_decode(case: MillionCase, query: np.ndarray, seq_len: int) -> np.ndarray:
    """float64 attention of one decode query [heads, head_dim] over positions 0..seq_len-1."""
    q = query.astype(np.float64)
    logits = np.empty((q.shape[0], seq_len))
    for begin in range(0, seq_len, REF_CHUNK):
        end = min(begin + REF_CHUNK, seq_len)
        k = _rows(case.key_cache, case.table, begin, end)
        logits[:, begin:end] = q @ k.T * case.scale
    logits -= logits.max(axis=1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(axis=1, keepdims=True)
    out = np.zeros_like(q)
    for begin in range(0, seq_len, REF_CHUNK):
        end = min(begin + REF_CHUNK, seq_len)
        out += weights[:, begin:end] @ _rows(case.value_cache, case.table, begin, end)
    return out


def _rows(cache: np.ndarray, table: np.ndarray, begin: int, end: int) -> np.ndarray:
    """Positions begin..end-1 of the sequence (KV head 0) as float64 [n, head_dim]."""
    first, last = begin // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
    blocks = cache[table[first:last + 1], 0].reshape(-1, HEAD_DIM)
    offset = begin - first * BLOCK_SIZE
    return blocks[offset:offset + end - begin].astype(np.float64)
