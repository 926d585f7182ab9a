"""The float64 reference itself, checked against independently built dense attention."""

from __future__ import annotations

import numpy as np
import torch

from kernels import reference


def _dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """softmax(q kᵀ scale) v for q [n_q, d], k/v [n_k, d], with an explicit causal-free mask."""
    logits = q @ k.T * scale
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def _scatter(contiguous: np.ndarray, block_ids: list[int], num_blocks: int, block_size: int):
    """Paged cache holding `contiguous` [n, kv_heads, d] in the given physical blocks."""
    n, kv_heads, d = contiguous.shape
    cache = np.full((num_blocks, kv_heads, block_size, d), 1e6)  # junk where unused
    for p in range(n):
        cache[block_ids[p // block_size], :, p % block_size] = contiguous[p]
    return cache


def test_hand_checkable_decode() -> None:
    # Two keys, one query head, head_dim 1: logits 0 and ln(3) -> weights 1/4, 3/4.
    kc = np.zeros((3, 1, 2, 1))
    vc = np.zeros((3, 1, 2, 1))
    kc[2, 0, 0, 0], kc[2, 0, 1, 0] = 0.0, np.log(3.0)
    vc[2, 0, 0, 0], vc[2, 0, 1, 0] = 4.0, 8.0
    out = reference.paged_attention_decode(
        np.ones((1, 1, 1)), kc, vc, np.array([[2]], np.int32), np.array([2], np.int32), 1.0
    )
    np.testing.assert_allclose(out[0, 0, 0], 0.25 * 4.0 + 0.75 * 8.0, rtol=1e-12)


def test_decode_matches_dense_gqa_shuffled_blocks() -> None:
    rng = np.random.default_rng(0)
    block_size, kv_heads, heads, d, num_blocks = 4, 2, 6, 8, 16
    lens = [1, 4, 11]
    perm = rng.permutation(num_blocks)
    tables = np.zeros((3, 4), np.int32)
    k_dense: list[np.ndarray] = []
    v_dense: list[np.ndarray] = []
    k_cache = np.zeros((num_blocks, kv_heads, block_size, d))
    v_cache = np.zeros_like(k_cache)
    next_block = 0
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        ids = [int(b) for b in perm[next_block : next_block + nb]]
        next_block += nb
        tables[s, :nb] = ids
        k = rng.standard_normal((n, kv_heads, d))
        v = rng.standard_normal((n, kv_heads, d))
        for p in range(n):
            k_cache[ids[p // block_size], :, p % block_size] = k[p]
            v_cache[ids[p // block_size], :, p % block_size] = v[p]
        k_dense.append(k)
        v_dense.append(v)
    q = rng.standard_normal((3, heads, d)) * 3
    out = reference.paged_attention_decode(q, k_cache, v_cache, tables, np.array(lens, np.int32), 0.5)
    for s in range(3):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            want = _dense_attention(q[s, h][None], k_dense[s][:, kv], v_dense[s][:, kv], 0.5)[0]
            np.testing.assert_allclose(out[s, h], want, rtol=1e-12, atol=1e-12)


def test_prefill_is_causal_dense() -> None:
    rng = np.random.default_rng(1)
    n, q_len, d, block_size = 7, 3, 4, 2
    k = rng.standard_normal((n, 1, d))
    v = rng.standard_normal((n, 1, d))
    ids = [3, 0, 2, 1]
    kc, vc = _scatter(k, ids, 4, block_size), _scatter(v, ids, 4, block_size)
    q = rng.standard_normal((q_len, 2, d))
    out = reference.paged_prefill_attention(
        q, kc, vc, np.array([ids], np.int32), np.array([n], np.int32),
        np.array([0, q_len], np.int32), 1.0,
    )
    for j in range(q_len):
        visible = n - q_len + j + 1
        for h in range(2):
            want = _dense_attention(q[j, h][None], k[:visible, 0], v[:visible, 0], 1.0)[0]
            np.testing.assert_allclose(out[j, h], want, rtol=1e-12)


def test_write_slots_and_copy_blocks_reference() -> None:
    kc = np.zeros((3, 1, 2, 2), np.float32)
    vc = np.zeros_like(kc)
    key = np.arange(6, dtype=np.float32).reshape(3, 1, 2) + 1
    reference.write_slots(key, -key, kc, vc, np.array([5, -1, 0], np.int64))
    np.testing.assert_array_equal(kc[2, 0, 1], [1, 2])
    np.testing.assert_array_equal(kc[0, 0, 0], [5, 6])
    np.testing.assert_array_equal(vc[2, 0, 1], [-1, -2])
    assert np.count_nonzero(kc) == 4  # token 1 (slot -1) was skipped
    # Sequential semantics: 2 -> 1 then 1 -> 0 leaves block 2's data in block 0.
    reference.copy_blocks([kc], [vc], np.array([[2, 1], [1, 0]], np.int64))
    np.testing.assert_array_equal(kc[0], kc[2])
    np.testing.assert_array_equal(vc[1], vc[2])


def test_reference_accepts_torch_bf16() -> None:
    kc = torch.ones((1, 1, 2, 2), dtype=torch.bfloat16)
    out = reference.paged_attention_decode(
        torch.ones((1, 1, 2)), kc, kc * 2, torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32), 1.0,
    )
    np.testing.assert_allclose(out, 2.0)
