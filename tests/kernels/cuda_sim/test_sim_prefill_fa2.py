"""The FA2-class prefill (tensor-core path) against the float64 reference, in the simulator.

The block holds 64 query rows at head_dim <= 128 (16 at 256) and walks double-buffered K/V
tiles of 32 tokens (16 at 256) shared by its warps; the simulator's `cp.async` lands copies
only at their wait, so a tile read early reads NaN. Cases cover ragged chunks, prefix hits
(a chunk after cached tokens), chunks ending mid-block, GQA 1 / 4 / 8, head dims 64 / 128 /
256, several row tiles per sequence, a per-token table lookup (block size 4), bf16 and a
float32 output (probabilities split in two 16-bit parts). Caches are NaN outside the
sequences' slots and tables shuffled (`sim_cases.make_case`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries

import kernels
from kernels import reference
from kernels.cuda._host import spec_for
from kernels.cuda.prefill import heaviest_first, query_rows_per_cta


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "block_size", "head_dim", "q_lens", "lens"),
    [
        # The default run keeps one case per block shape (64 rows at d64, 16 rows at d256) at
        # the smallest size that still spans several row and K/V tiles; the larger ones (35-90 s
        # each in the simulator on the 2-core CI machine) run with --slow (issue 24).
        # MHA d64, 2 KV heads: a 40-token prompt over two K/V tiles; a 5-token chunk after a
        # 16-token prefix hit, ending mid-block (21 = 16 + 5)
        pytest.param(2, 1, 16, 64, [40, 5], [40, 21], marks=pytest.mark.slow),
        # GQA 4 d128: 17 tokens x 4 heads = 68 rows, two row tiles (the second holds 4 rows),
        # after a 33-token prefix; a 3-token chunk ending mid-block (block 8)
        pytest.param(1, 4, 8, 128, [17, 3], [50, 12], marks=pytest.mark.slow),
        # GQA 8 d256: 16 rows per block = 2 tokens; ragged 3 / 6 token chunks
        pytest.param(1, 8, 16, 256, [3, 6], [37, 6], marks=pytest.mark.slow),
        # the same at d256, smaller: 3 / 2 token chunks (2 row blocks for the first), the first
        # after a 16-token prefix (two 16-token K/V tiles), the second ending mid-block
        (1, 8, 16, 256, [3, 2], [19, 2]),
        # block 4: every row looked up through the table; 70 rows = two row tiles, 3 tiles
        (1, 1, 4, 64, [70, 1], [75, 9]),
    ],
)
def test_fa2_prefill_matches_float64(num_kv_heads, group, block_size, head_dim, q_lens,
                                     lens) -> None:
    spec = spec_for(head_dim, block_size, num_kv_heads, group, "f16", "f16", "f16", "prefill")
    assert spec.path == "tc" and query_rows_per_cta(spec) == (64 if head_dim <= 128 else 16)
    rng = np.random.default_rng(sum(lens) + head_dim + group)
    case = make_case(rng, lens, num_kv_heads=num_kv_heads, block_size=block_size,
                     head_dim=head_dim, dtype=np.float16)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = queries(rng, (int(starts[-1]), num_kv_heads * group, head_dim), np.float16)
    out = np.full(q.shape, np.nan, dtype=np.float16)
    kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, starts,
        case.scale, out=out, backend="cuda", max_query_len=max(q_lens))
    ref = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, starts, case.scale)
    assert_close(out, ref, 1e-3)


def test_fa2_prefill_bf16_and_float32_output() -> None:
    """bf16 caches (P split hi + lo), GQA 4, into a float32 output."""
    rng = np.random.default_rng(77)
    case = make_case(rng, [30, 9], num_kv_heads=1, block_size=8, head_dim=32, dtype=np.float32)
    kc = torch.from_numpy(case.key_cache).bfloat16()
    vc = torch.from_numpy(case.value_cache).bfloat16()
    starts = torch.tensor([0, 20, 24], dtype=torch.int32)
    q = torch.from_numpy(queries(rng, (24, 4, 32), np.float32)).bfloat16()
    out = torch.full((24, 4, 32), float("nan"), dtype=torch.float32)
    kernels.paged_prefill_attention(q, kc, vc, torch.from_numpy(case.block_tables),
                                    torch.from_numpy(case.seq_lens), starts, case.scale, out=out,
                                    backend="cuda")
    ref = reference.paged_prefill_attention(q, kc, vc, case.block_tables, case.seq_lens, starts,
                                            case.scale)
    assert_close(out.double().numpy(), ref, 8e-3)


def test_fa2_prefill_rescale_only_when_a_maximum_rises() -> None:
    """The O rescale is skipped when the warp vote says no row maximum rose (issue 43): keys
    built so that the maximum rises late (one dominant key at position 35 of 40), never after
    the first slice (position 0 dominant), and on every slice (logits growing with position),
    each after a cached prefix, against the float64 reference. A missed rescale leaves O at
    the old scale and fails here (checked by making the vote always skip)."""
    rng = np.random.default_rng(43)
    head_dim, group = 32, 2
    case = make_case(rng, [40, 44, 36], num_kv_heads=1, block_size=16, head_dim=head_dim)
    for seq, (n, spike) in enumerate(zip(case.seq_lens, (35, 0, None))):
        for pos in range(int(n)):
            block, off = case.block_tables[seq, pos // 16], pos % 16
            rise = 0.25 * pos if spike is None else (8.0 if pos == spike else 0.0)
            case.key_cache[block, 0, off, 0] = rise
    starts = np.array([0, 24, 44, 64], dtype=np.int32)  # chunks of 24 / 20 / 20 after prefixes
    q = (rng.standard_normal((64, group, head_dim)) * 0.5).astype(np.float16)
    q[:, :, 0] = 4.0  # the built key dimension dominates every logit
    out = np.full(q.shape, np.nan, dtype=np.float16)
    kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, starts,
        case.scale, out=out, backend="cuda", max_query_len=24)
    ref = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, starts, case.scale)
    assert_close(out, ref, 1e-3)


def test_heaviest_row_tiles_start_first() -> None:
    """Block x of a grid of n row tiles computes row tile n - 1 - x: the longest causal
    ranges start in the first wave (issue 43); every tile is still computed once."""
    order = [heaviest_first(x, 5) for x in range(5)]
    assert order == [4, 3, 2, 1, 0]
