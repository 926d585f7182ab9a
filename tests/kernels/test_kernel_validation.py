"""Bad kernel input fails with KernelInputError before anything is written; dispatch rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from paged_cases import make_case

import kernels
import kernels.cpu.api
from kernels import KernelInputError


@pytest.fixture
def case():
    return make_case(np.random.default_rng(0), [5, 20, 33], num_heads=4, num_kv_heads=2,
                     head_dim=16, block_size=8, query_lens=None)


def _decode(case, **overrides: Any) -> Any:
    args = {"query": case.query, "key_cache": case.key_cache, "value_cache": case.value_cache,
            "block_tables": case.block_tables, "seq_lens": case.seq_lens, "scale": case.scale}
    args.update(overrides)
    return kernels.paged_attention_decode(**args)


DECODE_BAD: dict[str, Callable[[Any], dict[str, Any]]] = {
    "cache float64": lambda c: {"key_cache": c.key_cache.astype(np.float64),
                                "value_cache": c.value_cache.astype(np.float64)},
    "k/v dtype mismatch": lambda c: {"value_cache": c.value_cache.astype(np.float32)},
    "k/v shape mismatch": lambda c: {"value_cache": c.value_cache[:-1].copy()},
    "cache 3-d": lambda c: {"key_cache": c.key_cache[0], "value_cache": c.value_cache[0]},
    "query non-contiguous": lambda c: {
        "query": np.ascontiguousarray(c.query.transpose(1, 0, 2)).transpose(1, 0, 2)},
    "query int": lambda c: {"query": c.query.astype(np.int32)},
    "heads not multiple": lambda c: {"query": np.zeros((3, 3, 16), np.float32)},
    "head_dim mismatch": lambda c: {"query": np.zeros((3, 4, 8), np.float32)},
    "tables int64": lambda c: {"block_tables": c.block_tables.astype(np.int64)},
    "tables rows": lambda c: {"block_tables": c.block_tables[:2].copy()},
    "seq_lens shape": lambda c: {"seq_lens": c.seq_lens[:2].copy()},
    "seq_len zero": lambda c: {"seq_lens": np.array([0, 20, 33], np.int32)},
    "seq_len beyond table": lambda c: {"seq_lens": np.array([5, 20, 10_000], np.int32)},
    "used block id too big": lambda c: {"block_tables": _with(c.block_tables, (1, 0), 999)},
    "used block id negative": lambda c: {"block_tables": _with(c.block_tables, (2, 4), -1)},
    "scale nan": lambda c: {"scale": float("nan")},
    "scale not a number": lambda c: {"scale": "big"},
    "out wrong shape": lambda c: {"out": np.zeros((3, 4, 8), np.float32)},
    "out wrong dtype": lambda c: {"out": np.zeros((3, 4, 16), np.float64)},
    "query is a list": lambda c: {"query": [[0.0]]},
    "unknown backend": lambda c: {"backend": "tpu"},
}


def _with(table: np.ndarray, index: tuple[int, int], value: int) -> np.ndarray:
    table = table.copy()
    table[index] = value
    return table


@pytest.mark.parametrize("name", list(DECODE_BAD))
def test_decode_rejects(case, name: str) -> None:
    with pytest.raises(KernelInputError):
        _decode(case, **DECODE_BAD[name](case))


def test_padding_past_used_blocks_is_not_checked(case) -> None:
    # Rows are padded with -1 past each sequence's last block; that must be accepted.
    assert (case.block_tables == -1).any()
    out = _decode(case)
    assert np.isfinite(out).all()


def test_prefill_rejects_bad_query_start_loc(case) -> None:
    case.query = np.zeros((10, 4, 16), np.float32)
    base = {"query": case.query, "key_cache": case.key_cache, "value_cache": case.value_cache,
            "block_tables": case.block_tables, "seq_lens": case.seq_lens, "scale": 1.0}
    bad = {
        "does not end at total": np.array([0, 2, 4, 9], np.int32),
        "does not start at 0": np.array([1, 2, 4, 10], np.int32),
        "decreasing": np.array([0, 5, 4, 10], np.int32),
        "q_len > seq_len": np.array([0, 6, 8, 10], np.int32),  # seq 0 has seq_len 5
        "wrong length": np.array([0, 10], np.int32),
        "int64": np.array([0, 2, 4, 10], np.int64),
    }
    for starts in bad.values():
        with pytest.raises(KernelInputError):
            kernels.paged_prefill_attention(query_start_loc=starts, **base)
    ok = kernels.paged_prefill_attention(query_start_loc=np.array([0, 2, 4, 10], np.int32), **base)
    assert ok.shape == (10, 4, 16)


def _slots_case():
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((4, 2, 8, 16)).astype(np.float16)
    key = rng.standard_normal((3, 2, 16)).astype(np.float16)
    return cache, cache.copy(), key


@pytest.mark.parametrize(
    "slots",
    [np.array([1, 2, 32], np.int64), np.array([1, 5, 5], np.int64), np.array([1, 2], np.int64),
     np.array([1, 2, 3], np.int32)],
    ids=["slot past pool", "duplicate slot", "length mismatch", "int32 slots"],
)
def test_write_slots_rejects_and_leaves_cache_untouched(slots: np.ndarray) -> None:
    key_cache, value_cache, key = _slots_case()
    before = key_cache.copy()
    with pytest.raises(KernelInputError):
        kernels.write_slots(key, key, key_cache, value_cache, slots)
    np.testing.assert_array_equal(key_cache, before)


def test_write_slots_rejects_dtype_and_shape_mismatch() -> None:
    key_cache, value_cache, key = _slots_case()
    slots = np.array([0, 1, 2], np.int64)
    with pytest.raises(KernelInputError):
        kernels.write_slots(key.astype(np.float32), key, key_cache, value_cache, slots)
    with pytest.raises(KernelInputError):
        kernels.write_slots(key[:, :1].copy(), key[:, :1].copy(), key_cache, value_cache, slots)
    # Repeated padding slots (-1) are fine: only non-negative duplicates race.
    kernels.write_slots(key, key, key_cache, value_cache, np.array([-1, 3, -1], np.int64))


def test_copy_blocks_rejects() -> None:
    rng = np.random.default_rng(2)
    caches = [rng.standard_normal((4, 1, 8, 8)).astype(np.float32) for _ in range(2)]
    before = [c.copy() for c in caches]
    ok = np.array([[0, 1]], np.int64)
    bad_calls = [
        (caches, caches, np.array([[0, 4]], np.int64)),
        (caches, caches, np.array([[-1, 2]], np.int64)),
        (caches, caches, np.array([[0, 1, 2]], np.int64)),
        (caches, caches, np.array([[0, 1]], np.int32)),
        (caches, caches[:1], ok),
        (caches[0], caches[0], ok),  # not a list
        ([caches[0], caches[1][:2].copy()], caches, ok),  # layer geometry differs
        ([caches[0], caches[1].astype(np.float16)], caches, ok),
    ]
    for key_caches, value_caches, mapping in bad_calls:
        with pytest.raises(KernelInputError):
            kernels.copy_blocks(key_caches, value_caches, mapping)
    for got, orig in zip(caches, before):
        np.testing.assert_array_equal(got, orig)


def test_auto_backend_on_cpu_data_picks_cpu(case, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = kernels.cpu.api.paged_attention_decode

    def spy(*args: Any) -> Any:
        calls.append("cpu")
        return real(*args)

    monkeypatch.setattr(kernels.cpu.api, "paged_attention_decode", spy)
    _decode(case, query=torch.from_numpy(case.query), backend="auto")
    _decode(case)
    assert calls == ["cpu", "cpu"]


def test_cpu_backend_refuses_device_arrays(case) -> None:
    class FakeDeviceArray:
        """Quacks like a Numba device array: shape, dtype, CUDA array interface."""

        def __init__(self, like: np.ndarray) -> None:
            self.shape, self.dtype = like.shape, like.dtype
            self.__cuda_array_interface__ = {"shape": like.shape}

        def is_c_contiguous(self) -> bool:
            return True

    with pytest.raises(KernelInputError, match="GPU"):
        _decode(case, key_cache=FakeDeviceArray(case.key_cache),
                value_cache=FakeDeviceArray(case.value_cache), backend="cpu")
