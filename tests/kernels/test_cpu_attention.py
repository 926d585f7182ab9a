"""CPU decode and prefill attention against the float64 reference.

Tolerances: the reference sees exactly the same (already fp16/bf16-rounded) K/V and query
values, so the kernels' only error sources are float32 accumulation with fast-math
reassociation (measured ~1e-6 relative) and the final rounding to the output dtype
(≤ 2^-11 relative per element for fp16, 2^-8 for bf16). Hence per (token, head) relative L2
error bounds of 1e-4 (fp32 output), 1e-3 (fp16 output, the issue's bound) and 8e-3 (bf16).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from paged_cases import assert_close_rel, expected_decode, expected_prefill, make_case

import kernels
from kernels.cpu import _parallel
from kernels.cpu import decode as cpu_decode

REL = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}



@pytest.fixture(autouse=True)
def all_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test inputs are small, and small calls run on one thread: force the prange path here
    (`test_small_calls_run_serially` covers the one-thread path)."""
    monkeypatch.setattr(_parallel, "SERIAL_MAX_ATTENTION_WORK", -1)


# Ragged: length 1, exactly one full block, one past a block, partial last blocks, and a
# context long enough for several split-K partitions (512 tokens each).
DECODE_LENS = [1, 16, 17, 100, 1100, 33]


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (16, 4), (16, 2), (8, 1)], ids=["mha", "gqa4", "gqa8", "mqa"]
)
@pytest.mark.parametrize("split", [False, True], ids=["single", "splitk"])
def test_decode_matches_reference(kv_dtype: str, num_heads: int, num_kv_heads: int, split: bool) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{kv_dtype}{num_heads}{split}".encode()))
    case = make_case(rng, DECODE_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     kv_dtype=kv_dtype)
    out = np.full(case.query.shape, np.nan, np.float32)  # poison: unwritten elements stay NaN
    got = cpu_decode.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.scale, out=out, split=split,
    )
    assert got is out
    assert_close_rel(out, expected_decode(case), REL["float32"])


@pytest.mark.parametrize("query_dtype", ["float16", "float32"])
def test_decode_public_api_output_dtype_follows_query(query_dtype: str) -> None:
    rng = np.random.default_rng(7)
    case = make_case(rng, [5, 64, 300], num_heads=8, num_kv_heads=2, head_dim=64,
                     query_dtype=query_dtype)
    out = kernels.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale
    )
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(query_dtype)
    assert_close_rel(out, expected_decode(case), REL[query_dtype])


def test_decode_torch_bf16_cache_and_fp16_query_zero_copy() -> None:
    rng = np.random.default_rng(8)
    case = make_case(rng, [3, 40, 129], num_heads=8, num_kv_heads=2, head_dim=64,
                     kv_dtype="bfloat16")
    query = torch.from_numpy(np.asarray(case.query)).to(torch.float16)
    case.query = query
    out = torch.full(query.shape, float("nan"), dtype=torch.float16)
    got = kernels.paged_attention_decode(
        query, case.key_cache, case.value_cache, torch.from_numpy(case.block_tables),
        torch.from_numpy(case.seq_lens), case.scale, out=out,
    )
    assert got is out
    assert_close_rel(out, expected_decode(case), REL["float16"])


def test_decode_out_may_have_other_dtype_than_query() -> None:
    rng = np.random.default_rng(9)
    case = make_case(rng, [20, 70], num_heads=4, num_kv_heads=2, head_dim=32,
                     query_dtype="float16")
    out = np.full(case.query.shape, np.nan, np.float32)
    got = kernels.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.scale, out=out,
    )
    assert got is out
    assert_close_rel(out, expected_decode(case), REL["float32"])


def test_split_rule_uses_split_only_for_few_items_and_long_contexts() -> None:
    threads = cpu_decode.numba.get_num_threads()
    assert cpu_decode.use_split(1, 1, 4096, 16)
    assert not cpu_decode.use_split(1, 1, 300, 16)  # one partition: nothing to split
    assert not cpu_decode.use_split(2 * threads, 8, 4096, 16)


def test_decode_split_and_single_agree_closely() -> None:
    rng = np.random.default_rng(10)
    case = make_case(rng, [2000, 700], num_heads=8, num_kv_heads=1, head_dim=64)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.scale)
    single = cpu_decode.paged_attention_decode(*args, split=False)
    split = cpu_decode.paged_attention_decode(*args, split=True)
    np.testing.assert_allclose(split, single, rtol=1e-4, atol=1e-5)


def test_decode_empty_batch_returns_empty() -> None:
    rng = np.random.default_rng(11)
    case = make_case(rng, [4], num_heads=2, num_kv_heads=1, head_dim=16)
    out = kernels.paged_attention_decode(
        np.zeros((0, 2, 16), np.float32), case.key_cache, case.value_cache,
        np.zeros((0, 2), np.int32), np.zeros((0,), np.int32), 1.0,
    )
    assert out.shape == (0, 2, 16)


def test_decode_nan_in_cache_propagates() -> None:
    """fast-math keeps NaN semantics (no `nnan`): a corrupted block shows up as NaN."""
    rng = np.random.default_rng(12)
    case = make_case(rng, [20, 20], num_heads=2, num_kv_heads=1, head_dim=16,
                     kv_dtype="float16")
    block = case.block_tables[0, 1]
    case.value_cache[block, 0, 2, 5] = np.nan
    out = kernels.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale
    )
    assert np.isnan(out[0]).any()
    assert np.isfinite(out[1]).all()


# (seq_len, q_len): chunked prefill onto a cached prefix, a full-prompt prefill, a single
# token, exactly one full block, a q_len spanning several query tiles.
PREFILL_SHAPES = [(1, 1), (16, 16), (40, 17), (300, 33), (700, 5), (64, 64)]


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (16, 4), (16, 2), (8, 1)], ids=["mha", "gqa4", "gqa8", "mqa"]
)
def test_prefill_matches_reference(kv_dtype: str, num_heads: int, num_kv_heads: int) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{kv_dtype}{num_heads}prefill".encode()))
    case = make_case(rng, [s for s, _ in PREFILL_SHAPES], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=64,
                     query_lens=[q for _, q in PREFILL_SHAPES], kv_dtype=kv_dtype)
    out = np.full(case.query.shape, np.nan, np.float32)
    got = kernels.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale, out=out,
    )
    assert got is out
    assert_close_rel(out, expected_prefill(case), REL["float32"])


def test_prefill_torch_fp16_and_empty_sequences() -> None:
    rng = np.random.default_rng(13)
    # The middle sequence has no query tokens this step (q_len 0): it must be skipped.
    case = make_case(rng, [50, 30, 90], num_heads=8, num_kv_heads=2, head_dim=64,
                     query_lens=[20, 0, 7], query_dtype="float16")
    query = torch.from_numpy(case.query)
    out = kernels.paged_prefill_attention(
        query, torch.from_numpy(case.key_cache), torch.from_numpy(case.value_cache),
        torch.from_numpy(case.block_tables), torch.from_numpy(case.seq_lens),
        torch.from_numpy(case.query_start_loc), case.scale,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert_close_rel(out, expected_prefill(case), REL["float16"])


# The tiled prefill kernel's geometry (`kernels/cpu/prefill.py`): key tiles of
# max(1, KEY_TILE // block_size) whole blocks (block 1: 64 blocks a tile; 48: one; 128: one block
# wider than KEY_TILE), query tiles of QUERY_TILE tokens x group rows handled four rows at a time
# (group 3 and 5: row groups straddle query tokens; MHA: four tokens with four causal limits),
# chunks that start mid-block and mid-tile onto a cached prefix, and diagonal key tiles.
@pytest.mark.parametrize("block_size", [1, 5, 16, 48, 128])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "kv_dtype"),
    [(9, 3, "float32"), (5, 5, "bfloat16"), (10, 2, "float16"), (6, 1, "float32")],
    ids=["smol-gqa3-f32", "mha-bf16", "gqa5-f16", "mqa6-f32"],
)
def test_prefill_key_tiles_and_row_groups(block_size: int, num_heads: int, num_kv_heads: int,
                                          kv_dtype: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"tiles{block_size}{num_heads}{kv_dtype}".encode()))
    shapes = [(130, 130), (200, 67), (65, 1), (129, 64), (7, 3), (300, 290)]
    case = make_case(rng, [s for s, _ in shapes], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=32, block_size=block_size, query_lens=[q for _, q in shapes],
                     kv_dtype=kv_dtype)
    out = np.full(case.query.shape, np.nan, np.float32)
    kernels.paged_prefill_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, case.query_start_loc, case.scale, out=out)
    assert_close_rel(out, expected_prefill(case), REL["float32"])


@pytest.mark.parametrize("num_heads", [1, 3])
def test_prefill_nan_reaches_only_the_rows_that_see_it(num_heads: int) -> None:
    """A NaN value at position p poisons the queries at p and after, never an earlier one: the
    causal mask of the Numba tiles (fp16/bf16 caches) is not a multiplication by zero (0 * NaN
    is NaN), also where rows that see different numbers of keys share a product
    (`_kv_block.accumulate_rows`). float32 caches prefill through torch's SDPA or the AVX2 flash
    tiles, whose masked probabilities are zeros times V (`prefill_sdpa.py` says why that is
    acceptable)."""
    rng = np.random.default_rng(15)
    case = make_case(rng, [100], num_heads=num_heads, num_kv_heads=1, head_dim=16,
                     query_lens=[100], kv_dtype="float16")
    p = 37
    case.value_cache[case.block_tables[0, p // 16], 0, p % 16, 3] = np.nan
    out = kernels.paged_prefill_attention(case.query, case.key_cache, case.value_cache,
                                          case.block_tables, case.seq_lens, case.query_start_loc,
                                          case.scale)
    assert np.isfinite(out[:p]).all()
    assert np.isnan(out[p:, :, 3]).all()


def test_prefill_last_token_equals_decode() -> None:
    """A prefill query at the last position sees the same context as a decode query."""
    rng = np.random.default_rng(14)
    case = make_case(rng, [77], num_heads=4, num_kv_heads=2, head_dim=32, query_lens=[9])
    prefill = kernels.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale,
    )
    decode = kernels.paged_attention_decode(
        case.query[-1:], case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.scale,
    )
    np.testing.assert_allclose(prefill[-1], decode[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_and_prefill_sweep(kv_dtype: str, block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    lens = [int(n) for n in rng.integers(1, 2500, size=12)] + [block_size, 1]
    case = make_case(rng, lens, num_heads=32, num_kv_heads=8, block_size=block_size,
                     kv_dtype=kv_dtype)
    out = kernels.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale
    )
    assert_close_rel(out, expected_decode(case), REL["float32"])
    q_lens = [min(n, int(q)) for n, q in zip(lens, rng.integers(1, 80, size=len(lens)))]
    case = make_case(rng, lens, num_heads=32, num_kv_heads=8, block_size=block_size,
                     kv_dtype=kv_dtype, query_lens=q_lens)
    out = kernels.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale,
    )
    assert_close_rel(out, expected_prefill(case), REL["float32"])


def test_decode_bf16_query_returns_bf16_tensor() -> None:
    rng = np.random.default_rng(15)
    case = make_case(rng, [9, 48], num_heads=4, num_kv_heads=2, head_dim=32,
                     kv_dtype="bfloat16", query_dtype="bfloat16")
    out = kernels.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert_close_rel(out, expected_decode(case), REL["bfloat16"])


_initial_threads = cpu_decode.numba.get_num_threads()


def make_decode_view(case, query):
    """The same caches and tables with one decode query per sequence."""
    return type(case)(query=query, key_cache=case.key_cache, value_cache=case.value_cache,
                      block_tables=case.block_tables, seq_lens=case.seq_lens, scale=case.scale)


def test_small_calls_run_serially_with_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(16)
    case = make_case(rng, [1, 16, 700], num_heads=8, num_kv_heads=1, head_dim=64,
                     query_lens=[1, 16, 9])
    args = (case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    decode_q = case.query[case.query_start_loc[1:] - 1]  # each sequence's last token
    threads_seen: list[int] = []
    real_section = _parallel.parallel_section

    def spy(serial: bool, chunk_size: int = 1):
        threads_seen.append(1 if serial else cpu_decode.numba.get_num_threads())
        return real_section(serial, chunk_size)

    monkeypatch.setattr(_parallel, "parallel_section", spy)
    monkeypatch.setattr(_parallel, "SERIAL_MAX_ATTENTION_WORK", 2**62)
    for split in (False, True):
        out = cpu_decode.paged_attention_decode(decode_q, *args, case.scale, split=split)
        np.testing.assert_allclose(
            out, expected_decode(make_decode_view(case, decode_q)), rtol=1e-4, atol=1e-5
        )
    out = kernels.paged_prefill_attention(case.query, *args, case.query_start_loc, case.scale)
    assert_close_rel(out, expected_prefill(case), REL["float32"])
    assert threads_seen == [1, 1, 1]
    assert cpu_decode.numba.get_num_threads() == _initial_threads  # restored

