"""Float64 NumPy reference implementations of the four paged-KV kernels.

These are the ground truth every backend (Numba CPU, Numba CUDA) is tested against. They are
written for obviousness, not speed: each sequence's paged K/V is gathered token by token into a
contiguous float64 array through its block table, then attention is the textbook
softmax(q·Kᵀ·scale)·V. No online softmax, no tiling, no shared code with the kernels, so a bug
in the kernels' blocking cannot be mirrored here.

Inputs may be NumPy arrays or CPU torch tensors (including bfloat16). Attention functions
return new float64 arrays; `write_slots` and `copy_blocks` mutate the caches in place.
Arguments are not validated here (call sites are tests that build valid inputs); the public
dispatcher in `kernels/__init__.py` is what validates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _f64(x: Any) -> np.ndarray:
    """A float64 NumPy copy of an array or CPU torch tensor (bf16 included)."""
    if hasattr(x, "detach"):
        return x.detach().to(device="cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _ints(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy().astype(np.int64)
    return np.asarray(x, dtype=np.int64)


def gather_context(
    cache: np.ndarray, block_table: np.ndarray, seq_len: int
) -> np.ndarray:
    """Contiguous `[seq_len, num_kv_heads, head_dim]` view of one sequence's paged cache.

    Position p lives in physical block `block_table[p // block_size]` at offset
    `p % block_size` — the definition of the paged layout.
    """
    block_size = cache.shape[2]
    rows = [cache[block_table[p // block_size], :, p % block_size, :] for p in range(seq_len)]
    return np.stack(rows, axis=0)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """softmax(q·kᵀ·scale)·v for one query head: q [head_dim], k, v [n, head_dim]."""
    logits = (k @ q) * scale
    weights = np.exp(logits - logits.max())
    weights /= weights.sum()
    return weights @ v


def paged_attention_decode(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: float,
) -> np.ndarray:
    """One query token per sequence attending to its whole paged context.

    query [num_seqs, num_heads, head_dim]; caches [num_blocks, num_kv_heads, block_size,
    head_dim]; query head h reads KV head `h // (num_heads // num_kv_heads)` (GQA/MQA).
    Returns float64 [num_seqs, num_heads, head_dim].
    """
    q = _f64(query)
    kc, vc = _f64(key_cache), _f64(value_cache)
    tables, lens = _ints(block_tables), _ints(seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // kc.shape[1]
    out = np.empty((num_seqs, num_heads, head_dim), dtype=np.float64)
    for s in range(num_seqs):
        k = gather_context(kc, tables[s], int(lens[s]))
        v = gather_context(vc, tables[s], int(lens[s]))
        for h in range(num_heads):
            out[s, h] = _attend(q[s, h], k[:, h // group], v[:, h // group], scale)
    return out


def paged_prefill_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
) -> np.ndarray:
    """Many query tokens per sequence, causal over the paged prefix plus themselves.

    Sequence s owns query rows `query_start_loc[s] … query_start_loc[s+1]-1`; its j-th query
    token sits at absolute position `seq_len - q_len + j` and attends to positions
    `0 … seq_len - q_len + j`. Returns float64 [total_query_tokens, num_heads, head_dim].
    """
    q = _f64(query)
    kc, vc = _f64(key_cache), _f64(value_cache)
    tables, lens, starts = _ints(block_tables), _ints(seq_lens), _ints(query_start_loc)
    num_heads = q.shape[1]
    group = num_heads // kc.shape[1]
    out = np.empty(q.shape, dtype=np.float64)
    for s in range(len(lens)):
        seq_len = int(lens[s])
        q_len = int(starts[s + 1] - starts[s])
        k = gather_context(kc, tables[s], seq_len)
        v = gather_context(vc, tables[s], seq_len)
        for j in range(q_len):
            row = int(starts[s]) + j
            visible = seq_len - q_len + j + 1
            for h in range(num_heads):
                kv = h // group
                out[row, h] = _attend(q[row, h], k[:visible, kv], v[:visible, kv], scale)
    return out


def write_slots(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any
) -> None:
    """Store token t's K/V at slot `slot_mapping[t]` (block `slot // block_size`, offset
    `slot % block_size`) for every KV head; negative slots are skipped (padding tokens)."""
    slots = _ints(slot_mapping)
    block_size = key_cache.shape[2]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = int(slot) // block_size, int(slot) % block_size
        key_cache[block, :, offset, :] = key[t]
        value_cache[block, :, offset, :] = value[t]


def copy_blocks(
    key_caches: Sequence[Any], value_caches: Sequence[Any], block_mapping: Any
) -> None:
    """Copy whole blocks src → dst in every layer, pair by pair in the given order.

    Sequential semantics: pair i sees the result of pairs 0 … i-1, exactly as if each pair were
    a separate call. The compute node relies on this because it applies CoW and defrag copy ops
    strictly in op order, and a later op may read a block an earlier op wrote.
    """
    pairs = _ints(block_mapping).reshape(-1, 2)
    for src, dst in pairs:
        for kc, vc in zip(key_caches, value_caches):
            kc[int(dst)] = _clone(kc[int(src)])
            vc[int(dst)] = _clone(vc[int(src)])


def _clone(block: Any) -> Any:
    return block.clone() if hasattr(block, "clone") else block.copy()
