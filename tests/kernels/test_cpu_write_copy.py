"""CPU write_slots and copy_blocks against the reference (bit-exact: they only move bytes)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from paged_cases import random_kv

import kernels
from kernels import reference

DTYPES = ["float16", "float32", "bfloat16"]
PARALLEL = importlib.import_module("kernels.cpu._parallel")


@pytest.fixture(params=["serial", "parallel"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test on one thread (small ops) and on all threads (large ops)."""
    threshold = -1 if request.param == "parallel" else 2**62
    monkeypatch.setattr(PARALLEL, "SERIAL_MAX_COPY_BYTES", threshold)
    return request.param


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x.copy()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(np.array_equal(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_slots_writes_only_mapped_slots(dtype: str, path: str) -> None:
    rng = np.random.default_rng(1)
    num_blocks, kv_heads, block_size, head_dim, num_tokens = 40, 4, 16, 64, 300
    key_cache = random_kv(rng, (num_blocks, kv_heads, block_size, head_dim), dtype)
    value_cache = random_kv(rng, (num_blocks, kv_heads, block_size, head_dim), dtype)
    key = random_kv(rng, (num_tokens, kv_heads, head_dim), dtype)
    value = random_kv(rng, (num_tokens, kv_heads, head_dim), dtype)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    slots[::7] = -1  # padding tokens: skipped
    want_k, want_v = _copy(key_cache), _copy(value_cache)
    old_k = _copy(key_cache)
    reference.write_slots(key, value, want_k, want_v, slots)
    kernels.write_slots(key, value, key_cache, value_cache, slots)
    assert _equal(key_cache, want_k) and _equal(value_cache, want_v)
    # Independent of the reference: untouched slots keep their old random values.
    flat_new = np.asarray(torch.as_tensor(key_cache).float()).transpose(0, 2, 1, 3).reshape(
        num_blocks * block_size, kv_heads, head_dim)
    flat_old = np.asarray(torch.as_tensor(old_k).float()).transpose(0, 2, 1, 3).reshape(
        num_blocks * block_size, kv_heads, head_dim)
    written = slots[slots >= 0]
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])
    np.testing.assert_array_equal(
        flat_new[written], np.asarray(torch.as_tensor(key).float())[slots >= 0]
    )


def test_write_slots_all_negative_changes_nothing() -> None:
    rng = np.random.default_rng(2)
    cache = random_kv(rng, (4, 2, 8, 16), "float16")
    before = cache.copy()
    key = random_kv(rng, (3, 2, 16), "float16")
    kernels.write_slots(key, key, cache, cache.copy(), np.full(3, -1, np.int64))
    np.testing.assert_array_equal(cache, before)


def _layers(rng, num_layers: int, dtype: str, shape=(12, 2, 16, 32)):
    return [random_kv(rng, shape, dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_in_order_semantics(dtype: str, path: str) -> None:
    rng = np.random.default_rng(3)
    key_caches, value_caches = _layers(rng, 3, dtype), _layers(rng, 3, dtype)
    # A chain (5→6 then 6→7: 7 receives 5's bytes), a self-copy, a destination written twice
    # (last pair wins), and a swap through a temporary.
    pairs = np.array(
        [[5, 6], [6, 7], [2, 2], [0, 9], [1, 9], [3, 11], [4, 3], [11, 4]], np.int64
    )
    originals = [_copy(c) for c in key_caches]
    want_k = [_copy(c) for c in key_caches]
    want_v = [_copy(c) for c in value_caches]
    reference.copy_blocks(want_k, want_v, pairs)
    kernels.copy_blocks(key_caches, value_caches, pairs)
    for got, want in zip(key_caches + value_caches, want_k + want_v):
        assert _equal(got, want)
    # Hand-checked, independent of the reference:
    for got, orig in zip(key_caches, originals):
        assert _equal(got[7], orig[5]) and _equal(got[9], orig[1])
        assert _equal(got[3], orig[4]) and _equal(got[4], orig[3])  # swapped
        assert _equal(got[0], orig[0]) and _equal(got[10], orig[10])  # untouched


def test_copy_blocks_mqa_and_empty_mapping(path: str) -> None:
    rng = np.random.default_rng(4)
    key_caches = _layers(rng, 2, "float32", shape=(6, 1, 16, 64))
    value_caches = _layers(rng, 2, "float32", shape=(6, 1, 16, 64))
    before = [c.copy() for c in key_caches]
    kernels.copy_blocks(key_caches, value_caches, np.zeros((0, 2), np.int64))
    for got, orig in zip(key_caches, before):
        np.testing.assert_array_equal(got, orig)
    kernels.copy_blocks(key_caches, value_caches, np.array([[1, 4]], np.int64))
    for got, orig in zip(key_caches, before):
        np.testing.assert_array_equal(got[4], orig[1])
