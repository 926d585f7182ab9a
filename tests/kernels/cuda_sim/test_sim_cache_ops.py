"""write_slots and copy_blocks CUDA kernels in the simulator, against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import reference


def _random_cache(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_write_slots_writes_only_given_slots(dtype) -> None:
    rng = np.random.default_rng(3)
    shape = (6, 2, 8, 16)  # [num_blocks, num_kv_heads, block_size, head_dim]
    kc, vc = _random_cache(rng, shape, dtype), _random_cache(rng, shape, dtype)
    k_ref, v_ref = kc.copy(), vc.copy()
    # 11 tokens (more than the simulator's 8-block grid: exercises the grid-stride loop),
    # two padding tokens, slots in shuffled blocks including the very last slot.
    slots = np.array([5, -1, 47, 8, 9, 30, -3, 0, 22, 41, 16], dtype=np.int64)
    key = rng.standard_normal((11, 2, 16)).astype(dtype)
    value = rng.standard_normal((11, 2, 16)).astype(dtype)
    kernels.write_slots(key, value, kc, vc, slots, backend="cuda")
    reference.write_slots(key, value, k_ref, v_ref, slots)
    np.testing.assert_array_equal(kc, k_ref)
    np.testing.assert_array_equal(vc, v_ref)
    # the two padding tokens' values went nowhere
    for t in (1, 6):
        assert not (kc == key[t][None, :, None, :]).all(axis=(1, 3)).any()


def test_write_slots_bf16_bits_preserved() -> None:
    rng = np.random.default_rng(4)
    kc = torch.from_numpy(_random_cache(rng, (3, 1, 4, 8), np.float32)).bfloat16()
    vc = torch.from_numpy(_random_cache(rng, (3, 1, 4, 8), np.float32)).bfloat16()
    k_ref, v_ref = kc.clone(), vc.clone()
    key = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    value = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    slots = torch.tensor([11, -1, 2], dtype=torch.int64)
    kernels.write_slots(key, value, kc, vc, slots, backend="cuda")
    reference.write_slots(key, value, k_ref, v_ref, slots)
    assert torch.equal(kc.view(torch.int16), k_ref.view(torch.int16))
    assert torch.equal(vc.view(torch.int16), v_ref.view(torch.int16))


@pytest.mark.parametrize(
    "pairs",
    [
        [[0, 4], [2, 5]],  # independent CoW copies: one wave
        [[1, 2], [2, 3], [3, 1]],  # chain reading what earlier pairs wrote, then a WAR
        [[1, 0], [0, 1], [5, 5], [1, 4], [1, 3]],  # swap-like + no-op + fan-out
    ],
)
def test_copy_blocks_sequential_semantics(pairs) -> None:
    rng = np.random.default_rng(len(pairs))
    shape = (6, 2, 4, 8)
    num_layers = 3
    keys = [_random_cache(rng, shape, np.float16) for _ in range(num_layers)]
    values = [_random_cache(rng, shape, np.float16) for _ in range(num_layers)]
    k_ref, v_ref = [k.copy() for k in keys], [v.copy() for v in values]
    mapping = np.asarray(pairs, dtype=np.int64)
    kernels.copy_blocks(keys, values, mapping, backend="cuda")
    reference.copy_blocks(k_ref, v_ref, mapping)
    for got, want in zip(keys + values, k_ref + v_ref):
        np.testing.assert_array_equal(got, want)
