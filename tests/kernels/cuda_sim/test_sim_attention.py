"""Numba CUDA attention kernels in the simulator, against the float64 reference.

Tolerances (relative to each output row's norm): the reference sees exactly the same
fp16/bf16 input values, so the error comes from float32 accumulation (~1e-6 over <= 100
tokens) plus rounding of the output element: fp32 out 1e-5; fp16 out 2^-11 ≈ 4.9e-4 per
element → 1e-3; bf16 out 2^-8 ≈ 3.9e-3 per element → 8e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import reference
from kernels.cuda import decode, decode_reduce, decode_split
from kernels.cuda._spec import AttentionSpec
from sim_cases import assert_close, make_case, queries

TOL = {np.float32: 1e-5, np.float16: 1e-3}


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype", "num_kv_heads", "group", "block_size", "head_dim", "lens"),
    [
        # GQA 4, fp16, lengths 1 / exactly one full block / partial / several blocks
        (np.float16, np.float16, 2, 4, 8, 32, [1, 8, 19, 37]),
        # MQA (one KV head, 8 query heads), fp32, block 16 with head dim 64
        (np.float32, np.float32, 1, 8, 16, 64, [16, 50, 3]),
        # MHA (group 1), fp32 queries over fp16 KV, block 4 (many tiles)
        (np.float16, np.float32, 4, 1, 4, 16, [13, 2]),
    ],
)
def test_decode_matches_reference(kv_dtype, q_dtype, num_kv_heads, group, block_size,
                                  head_dim, lens) -> None:
    rng = np.random.default_rng(len(lens) * 31 + block_size)
    case = make_case(rng, lens, num_kv_heads=num_kv_heads, block_size=block_size,
                     head_dim=head_dim, dtype=kv_dtype)
    q = queries(rng, (len(lens), num_kv_heads * group, head_dim), q_dtype)
    out = np.full(q.shape, np.nan, dtype=q_dtype)
    result = kernels.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale,
        out=out, backend="cuda",
    )
    assert result is out
    ref = reference.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(out, ref, TOL[q_dtype])


def test_decode_shipped_thread_count() -> None:
    """The 128-thread variant a GPU runs (the simulator default is 32 threads)."""
    rng = np.random.default_rng(7)
    case = make_case(rng, [29], num_kv_heads=1, block_size=16, head_dim=32)
    q = queries(rng, (1, 4, 32), np.float16)
    out = np.full(q.shape, np.nan, dtype=np.float16)
    spec = AttentionSpec(32, 16, 4, "f16", "f16", "f16", num_threads=128)
    decode.decode_kernel(spec)[(1, 1), 128](
        out, q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        np.float32(case.scale))
    ref = reference.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(out, ref, 1e-3)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_split_decode_matches_reference(dtype) -> None:
    """Partitions of 16 tokens over blocks of 8: several partitions per sequence, partitions
    past a short sequence's end, a partial last partition; then the reduce kernel."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [53, 5], num_kv_heads=1, block_size=8, head_dim=32, dtype=dtype)
    q = queries(rng, (2, 4, 32), dtype)
    out = np.full(q.shape, np.nan, dtype=dtype)
    decode_split.paged_attention_decode_split(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale,
        out, partition_size=16)
    ref = reference.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(out, ref, TOL[dtype])


def test_decode_bf16_torch_tensors() -> None:
    """bf16 crosses as int16 bits and is converted in-kernel; output bf16 (query dtype)."""
    rng = np.random.default_rng(5)
    case = make_case(rng, [9, 22], num_kv_heads=2, block_size=8, head_dim=16,
                     dtype=np.float32)
    kc = torch.from_numpy(case.key_cache).bfloat16()
    vc = torch.from_numpy(case.value_cache).bfloat16()
    q = torch.from_numpy(queries(rng, (2, 4, 16), np.float32)).bfloat16()
    out = kernels.paged_attention_decode(
        q, kc, vc, torch.from_numpy(case.block_tables), torch.from_numpy(case.seq_lens),
        case.scale, backend="cuda")
    assert out.dtype == torch.bfloat16
    ref = reference.paged_attention_decode(
        q, kc, vc, case.block_tables, case.seq_lens, case.scale)
    assert_close(out.double().numpy(), ref, 8e-3)


@pytest.mark.parametrize(
    ("kv_dtype", "num_kv_heads", "group", "block_size", "q_lens", "lens"),
    [
        # GQA 4 (4 query tokens per tile): cached prefix + 7 new tokens; a 1-token chunk
        (np.float16, 1, 4, 8, [7, 1], [30, 12]),
        # MHA (16 query tokens per tile): a whole prompt without prefix (q_len == seq_len)
        # spanning two query tiles, and a chunk after a prefix ending mid-block
        (np.float32, 2, 1, 4, [20, 3], [20, 11]),
        # MQA group 8 (2 query tokens per tile), block 16
        (np.float16, 1, 8, 16, [5, 2], [21, 16]),
    ],
)
def test_prefill_matches_reference(kv_dtype, num_kv_heads, group, block_size, q_lens,
                                   lens) -> None:
    rng = np.random.default_rng(sum(lens))
    head_dim = 16
    case = make_case(rng, lens, num_kv_heads=num_kv_heads, block_size=block_size,
                     head_dim=head_dim, dtype=kv_dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = queries(rng, (int(starts[-1]), num_kv_heads * group, head_dim), kv_dtype)
    out = np.full(q.shape, np.nan, dtype=kv_dtype)
    kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, starts,
        case.scale, out=out, backend="cuda")
    ref = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, starts,
        case.scale)
    assert_close(out, ref, TOL[kv_dtype])


@pytest.mark.parametrize(
    ("block_size", "head_dim", "window", "lens", "part_blocks"),
    [
        # 12 blocks through a 2-entry table window: the window is refreshed 5 times
        (4, 16, 2, [45, 6], 4),
        # 32-token blocks staged as two 16-token tiles (register cap), window of one block
        (32, 32, 1, [70, 33], 2),
    ],
)
def test_decode_table_window_and_sub_block_tiles(block_size, head_dim, window, lens,
                                                 part_blocks) -> None:
    rng = np.random.default_rng(block_size)
    case = make_case(rng, lens, num_kv_heads=1, block_size=block_size, head_dim=head_dim)
    q = queries(rng, (len(lens), 2, head_dim), np.float16)
    spec = AttentionSpec(head_dim, block_size, 2, "f16", "f16", "f16", num_threads=32,
                         prefetch_window=window)
    assert spec.tile_tokens == min(block_size, 16)
    ref = reference.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    out = np.full(q.shape, np.nan, dtype=np.float16)
    decode.decode_kernel(spec)[(len(lens), 1), 32](
        out, q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        np.float32(case.scale))
    assert_close(out, ref, 1e-3)
    # split-K with partitions that start mid-table (window starts at tok_begin's block)
    out = np.full(q.shape, np.nan, dtype=np.float16)
    part = part_blocks * block_size
    max_parts = -(-case.block_tables.shape[1] * block_size // part)
    tmp_out = np.full((len(lens), 2, max_parts, head_dim), np.nan, dtype=np.float32)
    tmp_max = np.full((len(lens), 2, max_parts), np.nan, dtype=np.float32)
    tmp_sum = np.full((len(lens), 2, max_parts), np.nan, dtype=np.float32)
    assert len(lens) * max_parts <= 8  # simulator budget: at most 8 thread blocks
    decode_split.split_kernel(spec, part)[(len(lens), 1, max_parts), 32](
        tmp_out, tmp_max, tmp_sum, q, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, np.float32(case.scale))
    decode_reduce.reduce_kernel(head_dim, "f16", 32, part)[(len(lens), 2), 32](
        out, tmp_out, tmp_max, tmp_sum, case.seq_lens)
    assert_close(out, ref, 1e-3)


def test_public_decode_routes_small_grids_to_split(monkeypatch) -> None:
    """One sequence x one KV head is below the saturation threshold and the table spans more
    than one 512-token partition, so the dispatch rule picks split-K; the partition past the
    sequence's end exits early and the reduce sees one partition."""
    calls = []
    real = decode_split.paged_attention_decode_split

    def spy(*args, **kwargs):
        calls.append(kwargs["partition_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_split, "paged_attention_decode_split", spy)
    rng = np.random.default_rng(2)
    case = make_case(rng, [40], num_kv_heads=1, block_size=8, head_dim=16, pad_blocks=65)
    assert case.block_tables.shape[1] * 8 > 512
    q = queries(rng, (1, 2, 16), np.float16)
    out = kernels.paged_attention_decode(q, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, case.scale, backend="cuda")
    assert calls == [512]
    ref = reference.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(out, ref, 1e-3)


def test_decode_kernel_survives_zero_length_from_device() -> None:
    """Device-resident lengths are not validated; a 0 must not read table padding (garbage
    10**6 here) or the cache: the row comes out as zeros, the other sequence is unaffected."""
    rng = np.random.default_rng(9)
    case = make_case(rng, [5, 12], num_kv_heads=1, block_size=4, head_dim=16)
    lens = np.array([0, 12], dtype=np.int32)
    case.block_tables[0, :] = 10**6
    q = queries(rng, (2, 2, 16), np.float16)
    out = np.full(q.shape, np.nan, dtype=np.float16)
    spec = AttentionSpec(16, 4, 2, "f16", "f16", "f16", num_threads=32)
    decode.decode_kernel(spec)[(2, 1), 32](
        out, q, case.key_cache, case.value_cache, case.block_tables, lens, np.float32(case.scale))
    assert (out[0] == 0).all()
    ref = reference.paged_attention_decode(q[1:], case.key_cache, case.value_cache,
                                           case.block_tables[1:], lens[1:], case.scale)
    assert_close(out[1:], ref, 1e-3)
