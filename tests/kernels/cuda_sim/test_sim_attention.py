"""Numba CUDA attention kernels in the simulator, against the float64 reference.

The simulator runs the same kernel source and thread-block shapes a GPU runs (128 threads for
head_dim <= 128, 64 beyond), with the machine operations of `_ops_sim.py`. Cases cover both
paths (tensor cores: fp16/bf16 with matching query type; SIMT: float32 caches, mixed types, odd
head dims), every way a step finds its rows (one block per step, one block per 8-token half,
a lookup per token; block sizes 1-24 including non-powers of two), table windows that advance
and jump, one and two row tiles, row blocks, and partial last steps.

Tolerances (relative to each output row's norm): fp16 output 1e-3 (element rounding 2^-11,
probabilities rounded to fp16 ≈ 2^-12); bf16 8e-3; float32 outputs 1e-5 (tensor-core
probabilities are then split into two 16-bit parts).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries, record_split_parts

import kernels
from kernels import reference
from kernels.cuda import decode, decode_policy, decode_split
from kernels.cuda._host import scale_log2, spec_for
from kernels.cuda._ops_sim import sim_ptr

TOL = {np.float32: 1e-5, np.float16: 1e-3}


def _decode(case, q, out, split=False, num_parts=None):
    if num_parts:
        return decode_split.paged_attention_decode_split(
            q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale,
            out, num_parts=num_parts)
    return decode.paged_attention_decode(q, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, case.scale, out, split=split)


def _reference(case, q):
    return reference.paged_attention_decode(q, case.key_cache, case.value_cache,
                                            case.block_tables, case.seq_lens, case.scale)


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype", "num_kv_heads", "group", "block_size", "head_dim", "lens"),
    [
        # tensor cores, GQA 4, one block per step; lengths 1 / a full step / partial steps
        (np.float16, np.float16, 2, 4, 16, 32, [1, 16, 37, 5]),
        # GQA 8, block 8: each 8-token half of a step in its own block
        (np.float16, np.float16, 1, 8, 8, 64, [50, 3]),
        # MHA, block 4: a table lookup per token
        (np.float16, np.float16, 2, 1, 4, 16, [13, 2]),
        # 12 rows (two row tiles), block 24 (not a power of two)
        (np.float16, np.float16, 1, 12, 24, 32, [61, 9]),
        # 20 heads per KV head: two row blocks (16 + 4 rows)
        (np.float16, np.float16, 1, 20, 16, 16, [30]),
        # block 2, 90 tokens: the table window advances (45 blocks > 32 entries)
        (np.float16, np.float16, 1, 4, 2, 16, [90]),
        # block 1: a warp's next step may skip a whole window
        (np.float16, np.float16, 1, 2, 1, 16, [75]),
        # SIMT: float32 caches, GQA 4, block 8
        (np.float32, np.float32, 2, 4, 8, 32, [37, 5]),
        # SIMT: float32 queries over fp16 caches (mixed types), MHA, block 4
        (np.float16, np.float32, 2, 1, 4, 16, [13, 2]),
        # SIMT: head_dim 12, GQA 3, block 4
        (np.float32, np.float32, 1, 3, 4, 12, [9, 20]),
        # SIMT: 12 rows (two row tiles in the merge), 2-token steps
        (np.float32, np.float32, 1, 12, 8, 16, [21]),
    ],
)
def test_decode_matches_reference(kv_dtype, q_dtype, num_kv_heads, group, block_size,
                                  head_dim, lens) -> None:
    rng = np.random.default_rng(len(lens) * 31 + block_size + group)
    case = make_case(rng, lens, num_kv_heads=num_kv_heads, block_size=block_size,
                     head_dim=head_dim, dtype=kv_dtype)
    q = queries(rng, (len(lens), num_kv_heads * group, head_dim), q_dtype)
    out = np.full(q.shape, np.nan, dtype=q_dtype)
    result = kernels.paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale,
        out=out, backend="cuda")
    assert result is out
    assert_close(out, _reference(case, q), TOL[q_dtype])


@pytest.mark.parametrize(("head_dim", "lens"), [(128, [40]), (256, [20])])
def test_decode_shipped_block_shape(head_dim: int, lens: list[int]) -> None:
    """The benchmark geometry (GQA 4, block 16, fp16) at its real width: head_dim 128 runs
    128 threads (4 warps), head_dim 256 runs 64 (2 warps) — the shapes a GPU launches."""
    spec = spec_for(head_dim, 16, 1, 4, "f16", "f16", "f16", "decode")
    assert spec.num_threads == (128 if head_dim == 128 else 64) and spec.path == "tc"
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, lens, num_kv_heads=1, block_size=16, head_dim=head_dim)
    q = queries(rng, (len(lens), 4, head_dim), np.float16)
    out = np.full(q.shape, np.nan, dtype=np.float16)
    _decode(case, q, out)
    assert_close(out, _reference(case, q), 1e-3)


def test_decode_bf16_torch_tensors() -> None:
    """bf16 caches and queries (torch): tensor cores in bf16, probabilities split hi + lo."""
    rng = np.random.default_rng(5)
    case = make_case(rng, [9, 40], num_kv_heads=2, block_size=8, head_dim=32, dtype=np.float32)
    kc = torch.from_numpy(case.key_cache).bfloat16()
    vc = torch.from_numpy(case.value_cache).bfloat16()
    q = torch.from_numpy(queries(rng, (2, 8, 32), np.float32)).bfloat16()
    out = kernels.paged_attention_decode(
        q, kc, vc, torch.from_numpy(case.block_tables), torch.from_numpy(case.seq_lens),
        case.scale, backend="cuda")
    assert out.dtype == torch.bfloat16
    ref = reference.paged_attention_decode(q, kc, vc, case.block_tables, case.seq_lens, case.scale)
    assert_close(out.double().numpy(), ref, 8e-3)


def test_decode_fp32_output_from_fp16() -> None:
    """fp16 queries/caches into a float32 `out`: probabilities carried as two fp16 parts."""
    rng = np.random.default_rng(6)
    case = make_case(rng, [33, 6], num_kv_heads=1, block_size=16, head_dim=32)
    q = queries(rng, (2, 4, 32), np.float16)
    out = np.full(q.shape, np.nan, dtype=np.float32)
    _decode(case, q, out)
    assert_close(out, _reference(case, q), 1e-5)


@pytest.mark.parametrize(
    ("dtype", "block_size", "lens", "num_parts"),
    [
        (np.float16, 8, [70, 9], 3),  # the short sequence leaves partitions empty
        pytest.param(np.float16, 2, [95, 40], 2, marks=pytest.mark.slow),  # partitions start inside a table window
        (np.float32, 4, [53, 5], 2),  # SIMT partitions
    ],
)
def test_split_decode_matches_reference(dtype, block_size, lens, num_parts) -> None:
    rng = np.random.default_rng(11 + block_size)
    case = make_case(rng, lens, num_kv_heads=2, block_size=block_size, head_dim=32, dtype=dtype)
    q = queries(rng, (len(lens), 8, 32), dtype)
    out = np.full(q.shape, np.nan, dtype=dtype)
    _decode(case, q, out, num_parts=num_parts)
    assert_close(out, _reference(case, q), TOL[dtype])


def test_public_decode_routes_small_grids_to_split(monkeypatch) -> None:
    """One sequence x one KV head fills a small part of what the (pretend) GPU keeps
    resident, so the policy (issue 43: wave efficiency, a common chunk size) picks split-K
    with the chunk that fills it best: 64-token partitions (thresholds scaled down)."""
    calls = record_split_parts(monkeypatch)
    monkeypatch.setattr(decode_policy, "MIN_PART_TOKENS", 32)
    monkeypatch.setattr(decode_policy, "MIN_SPLIT_TOKENS", 64)
    monkeypatch.setattr(decode, "resident_blocks", lambda spec: decode_policy.Occupancy(8, 8))
    rng = np.random.default_rng(2)
    case = make_case(rng, [200], num_kv_heads=1, block_size=8, head_dim=16)
    q = queries(rng, (1, 2, 16), np.float16)
    out = kernels.paged_attention_decode(q, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, case.scale, backend="cuda")
    assert calls == [[4]]  # ceil(200 / 64): 4 of 8 slots busy beats 2 (128-token parts)
    assert_close(out, _reference(case, q), 1e-3)


def test_zero_length_from_device_yields_zeros() -> None:
    """Device-resident lengths are not validated; a 0 (also a graph bucket's padded row) must
    read no table entry (garbage 10**6 here) and no cache slot: the row comes out as zeros, in
    the one-pass kernel and through split-K's reduce, and the other sequence is unaffected."""
    rng = np.random.default_rng(9)
    case = make_case(rng, [5, 40], num_kv_heads=1, block_size=4, head_dim=16)
    case.seq_lens = np.array([0, 40], dtype=np.int32)
    case.block_tables[0, :] = 10**6
    q = queries(rng, (2, 2, 16), np.float16)
    ref = reference.paged_attention_decode(q[1:], case.key_cache, case.value_cache,
                                           case.block_tables[1:], case.seq_lens[1:], case.scale)
    for num_parts in (None, 2):
        out = np.full(q.shape, np.nan, dtype=np.float16)
        spec = spec_for(16, 4, 1, 2, "f16", "f16", "f16", "decode")
        if num_parts is None:
            decode.decode_kernel(spec)[(1, 2), spec.num_threads](
                sim_ptr(out), sim_ptr(q), sim_ptr(case.key_cache), sim_ptr(case.value_cache),
                sim_ptr(case.block_tables), sim_ptr(case.seq_lens), case.block_tables.shape[1],
                scale_log2(case.scale))
        else:
            _decode(case, q, out, num_parts=num_parts)
        assert (out[0] == 0).all()
        assert_close(out[1:], ref, 1e-3)


@pytest.mark.parametrize(
    ("kv_dtype", "num_kv_heads", "group", "block_size", "head_dim", "q_lens", "lens"),
    [
        # tensor cores, GQA 4 (4 query tokens per 16-row tile): prefix + 7 new; a 1-token chunk
        (np.float16, 1, 4, 8, 32, [7, 1], [30, 12]),
        # MHA: a whole prompt (q_len == seq_len) over two row tiles; a chunk after a prefix
        # ending mid-block; block 4 (a lookup per token)
        (np.float16, 2, 1, 4, 16, [20, 3], [20, 11]),
        # GQA 8 (2 query tokens per tile), block 16, head_dim 128: the shipped width (~20 s in the
        # simulator: --slow; the default run compiles this width for sm_90 in test_cuda_compile_ptx)
        pytest.param(np.float16, 1, 8, 16, 128, [5, 2], [21, 16], marks=pytest.mark.slow),
        # SIMT (float32): MHA, block 4, 4-row tiles
        (np.float32, 1, 1, 4, 16, [20, 3], [20, 11]),
    ],
)
def test_prefill_matches_reference(kv_dtype, num_kv_heads, group, block_size, head_dim, q_lens,
                                   lens) -> None:
    rng = np.random.default_rng(sum(lens) + head_dim)
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


def test_prefill_mixed_types_torch() -> None:
    """fp16 queries over bf16 caches into a float32 output (the SIMT path)."""
    rng = np.random.default_rng(21)
    case = make_case(rng, [13, 6], num_kv_heads=1, block_size=4, head_dim=16, dtype=np.float32)
    kc = torch.from_numpy(case.key_cache).bfloat16()
    vc = torch.from_numpy(case.value_cache).bfloat16()
    starts = torch.tensor([0, 5, 11], dtype=torch.int32)
    q = torch.from_numpy(queries(rng, (11, 2, 16), np.float32)).half()
    out = torch.full((11, 2, 16), float("nan"), dtype=torch.float32)
    kernels.paged_prefill_attention(q, kc, vc, torch.from_numpy(case.block_tables),
                                    torch.from_numpy(case.seq_lens), starts, case.scale, out=out,
                                    backend="cuda")
    ref = reference.paged_prefill_attention(q, kc, vc, case.block_tables, case.seq_lens, starts,
                                            case.scale)
    assert_close(out.double().numpy(), ref, 1e-5)
