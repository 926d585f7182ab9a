"""Launch configurations of the prefill kernel stay inside CUDA's grid limits (no GPU needed).

Before issue 22 the prefill grid was (KV heads, sequences, tiles of the *total* batched tokens):
grid.z passed 65,535 above ~131k batched tokens at G=8 (d <= 128) and the launch failed. The
grid is now planned on the host from the longest chunk, row tiles in grid.x, sequences split
over several launches when there are more than grid.z holds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compute_node.model.batch import SeqWork, prepare_step
from compute_node.pool import PoolGeometry
from kernels._validate import KernelInputError
from kernels.cuda._host import spec_for
from kernels.cuda._spec import MAX_HEAD_DIM
from kernels.cuda.prefill import (
    MAX_GRID_X,
    MAX_GRID_YZ,
    plan_prefill_launches,
    query_rows_per_cta,
)

GROUPS = (1, 2, 4, 8, 16)
KINDS = ("f16", "bf16", "f32")


def _supported_specs():
    """Every (head dim, dtype, G) the CUDA backend accepts, as prefill specs."""
    for head_dim in range(4, MAX_HEAD_DIM + 1, 4):
        for kind in KINDS:
            for group in GROUPS:
                try:
                    spec = spec_for(head_dim, 16, 8, group, kind, kind, kind, "prefill")
                except KernelInputError:
                    continue  # a head dim this dtype cannot run: refused before any launch
                yield spec


def _check_plan(spec, q_lens: list[int]) -> None:
    longest = max(q_lens)
    launches = plan_prefill_launches(spec, len(q_lens), longest)
    rows = query_rows_per_cta(spec)
    next_seq = 0  # launches cover sequences 0.. as consecutive runs: every sequence once, in order
    for launch in launches:
        x, y, z = launch.grid
        assert 1 <= x <= MAX_GRID_X and 1 <= y <= MAX_GRID_YZ and 1 <= z <= MAX_GRID_YZ
        assert y == spec.num_kv_heads
        # every row of the longest chunk has a tile, and no tile is wholly surplus
        assert x * rows >= longest * spec.group_size
        assert (x - 1) * rows < longest * spec.group_size or x == 1
        assert launch.seq0 == next_seq, (launch.seq0, next_seq)
        next_seq += z
    assert next_seq == len(q_lens)


def test_every_supported_variant_plans_200k_batched_tokens_and_a_1m_prompt() -> None:
    specs = list(_supported_specs())
    assert len(specs) > 100  # the sweep really covers the head dims x dtypes x groups
    two_token_chunks = [2] * 100_000
    for spec in specs:
        _check_plan(spec, [200_000])            # one 200k-token chunk
        _check_plan(spec, two_token_chunks)     # 200k tokens as 100k two-token chunks
        _check_plan(spec, [1_000_000])          # a million-token prompt in one chunk
        _check_plan(spec, [3, 1, 999_990, 6])   # ragged, the longest sizes the grid


def test_old_layout_would_overflow_where_the_plan_does_not() -> None:
    spec = spec_for(128, 16, 8, 8, "f16", "f16", "f16", "prefill")
    total = 200_000
    old_z = math.ceil(total * spec.group_size / 16)  # grid.z of the old layout (16 rows)
    assert old_z > MAX_GRID_YZ
    (launch,) = plan_prefill_launches(spec, 4, 50_000)
    assert query_rows_per_cta(spec) == 64  # FA2 class
    assert launch.grid == (math.ceil(50_000 * 8 / 64), 8, 4)


def test_many_sequences_split_into_launches_of_at_most_65535() -> None:
    spec = spec_for(64, 16, 2, 4, "f16", "f16", "f16", "prefill")
    launches = plan_prefill_launches(spec, 150_000, 2)
    assert [(x.seq0, x.grid[2]) for x in launches] == [
        (0, 65_535), (65_535, 65_535), (131_070, 18_930)]
    assert plan_prefill_launches(spec, 0, 0) == []


def test_plan_refuses_a_chunk_no_grid_can_hold() -> None:
    spec = spec_for(128, 16, 8, 16, "f16", "f16", "f16", "prefill")
    rows = query_rows_per_cta(spec)
    too_long = (MAX_GRID_X + 1) * rows // spec.group_size + rows
    with pytest.raises(KernelInputError, match="split the prompt"):
        plan_prefill_launches(spec, 1, too_long)


def test_validation_refuses_a_max_query_len_below_the_longest_chunk() -> None:
    import kernels

    rng = np.random.default_rng(0)
    kc = rng.standard_normal((4, 1, 4, 8)).astype(np.float32)
    q = rng.standard_normal((5, 2, 8)).astype(np.float32)
    tables = np.arange(4, dtype=np.int32).reshape(2, 2)
    lens = np.array([3, 6], np.int32)
    starts = np.array([0, 2, 5], np.int32)
    with pytest.raises(KernelInputError, match="below the longest chunk"):
        kernels.paged_prefill_attention(q, kc, kc, tables, lens, starts, 0.3, max_query_len=2)
    with pytest.raises(KernelInputError, match="integer >= 0"):
        kernels.paged_prefill_attention(q, kc, kc, tables, lens, starts, 0.3, max_query_len=-1)
    out = kernels.paged_prefill_attention(q, kc, kc, tables, lens, starts, 0.3, max_query_len=3)
    assert np.isfinite(out).all()


def test_prepare_step_passes_the_longest_prefill_chunk_on_the_host() -> None:
    geometry = PoolGeometry(1, 1, 8, "float32", 4, 64)
    batch = [
        SeqWork("d", [1], 5, [0, 1]),                          # decode: not a prefill chunk
        SeqWork("a", list(range(7)), 0, [2, 3]),               # 7 new tokens
        SeqWork("b", list(range(3)), 9, [4, 5, 6]),            # 3 new tokens after a prefix
    ]
    step = prepare_step(batch, geometry, vocab_size=100, max_model_len=64, head_dim=8,
                        device=torch.device("cpu"))
    assert step.meta.prefill_max_query_len == 7
    decode_only = prepare_step(batch[:1], geometry, vocab_size=100, max_model_len=64,
                               head_dim=8, device=torch.device("cpu"))
    assert decode_only.meta.prefill_max_query_len is None


def test_split_k_plans_a_million_token_sequence_within_limits_and_scratch() -> None:
    """A 1M-token sequence (62,500 blocks of 16) decoded split-K: partitions <= MAX_PARTS, the
    grid within CUDA's limits, scratch at its documented bound, every token in a partition."""
    from kernels.cuda.decode_policy import MAX_PARTS, PART_ALIGN, Occupancy
    from kernels.cuda.decode_split import parts_for, split_launch

    tables = np.zeros((1, 62_500), np.int32)
    lens = np.array([1_000_000], np.int32)

    class DeviceLens:  # device-resident lengths: the table capacity bounds the context
        shape, dtype = (1,), np.dtype(np.int32)

        @property
        def __cuda_array_interface__(self) -> dict[str, tuple[int, ...]]:
            return {"shape": (1,)}

    checked = 0
    for head_dim in (64, 128, 256):
        for kind in KINDS:
            for group in GROUPS:
                spec = spec_for(head_dim, 16, 8, group, kind, kind, kind, "split")
                # an H100/H200's resident blocks; a tiny GPU
                for occupancy in (Occupancy(132 * 6, 132 * 5), Occupancy(8, 8)):
                    for forced in (None, True):
                        found = parts_for(spec, 1, tables, lens, forced, occupancy)
                        on_device = parts_for(spec, 1, tables, DeviceLens(), forced, occupancy)
                        parts = 1 if found is None else int(found[0])
                        assert parts == (1 if on_device is None else int(on_device[0]))
                        assert 1 <= parts <= MAX_PARTS
                        (x, y), words = split_launch(spec, parts)
                        assert x <= MAX_GRID_X and y <= MAX_GRID_YZ
                        assert words <= MAX_PARTS * spec.num_heads * (head_dim + 2)
                        per = -(-1_000_000 // parts)
                        per = -(-per // PART_ALIGN) * PART_ALIGN  # as decode_reduce.part_tokens
                        assert per * parts >= 1_000_000
                        checked += 1
    assert checked == 3 * len(KINDS) * len(GROUPS) * 4
    spec = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "split")
    _, words = split_launch(spec, MAX_PARTS)
    assert words * 4 == 64 * 32 * 130 * 4  # 1.06 MB for one 1M-token sequence, 32 heads
    with pytest.raises(KernelInputError, match="exceed one grid"):
        split_launch(spec, MAX_GRID_YZ + 1)
