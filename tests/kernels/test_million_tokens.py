"""A million-token sequence through the CPU decode, against float64 (--slow: ~256 MB of K/V).

62,500 blocks of 16 tokens (1 KV head, head dim 64, fp16, shuffled table); decode queries at
sampled positions of the same sequence (the last token, one before it, just past a power of
two, mid-block, the first token), single-pass and split-K. The grid planning of the CUDA
kernels at this length is tested without a GPU in test_cuda_launch_limits.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from bench_modules import load_bench

import kernels
from kernels.cpu import decode as cpu_decode


def _million_case():
    return load_bench("million_case")


MC = _million_case()
POSITIONS = [MC.MILLION, MC.MILLION - 1, (1 << 19) + 1, 65_543, 1]


@pytest.fixture(scope="module")
def case():
    return MC.make_million_case(seed=22)


def test_case_geometry_without_building_it() -> None:
    assert MC.NUM_BLOCKS == 62_500 and MC.NUM_BLOCKS * MC.BLOCK_SIZE == 1_000_000
    # K + V at fp16: 2 x 1M x 64 x 2 bytes
    assert 2 * MC.MILLION * MC.HEAD_DIM * 2 == 256_000_000


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_cpu_decode_at_a_million_tokens_matches_float64(case, split: bool) -> None:
    assert case.kv_bytes == 256_000_000
    rng = np.random.default_rng(7)
    n = len(POSITIONS)
    query = (rng.standard_normal((n, MC.GROUP, MC.HEAD_DIM)) * 3).astype(np.float32)
    tables = np.broadcast_to(case.table, (n, MC.NUM_BLOCKS)).copy()
    lens = np.array(POSITIONS, np.int32)
    out = cpu_decode.paged_attention_decode(query, case.key_cache, case.value_cache, tables,
                                            lens, case.scale, split=split)
    for i, pos in enumerate(POSITIONS):
        ref = MC.reference_decode(case, query[i], pos)
        err = np.linalg.norm(out[i] - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert np.isfinite(out[i]).all()
        assert err.max() < 2e-3, (pos, err)


@pytest.mark.slow
def test_public_decode_validates_and_runs_at_a_million_tokens(case) -> None:
    query = np.ones((1, MC.GROUP, MC.HEAD_DIM), np.float32)
    out = kernels.paged_attention_decode(query, case.key_cache, case.value_cache,
                                         case.table[None, :], np.array([MC.MILLION], np.int32),
                                         case.scale, backend="cpu")
    ref = MC.reference_decode(case, query[0], MC.MILLION)
    assert np.abs(out[0] - ref).max() < 2e-3
