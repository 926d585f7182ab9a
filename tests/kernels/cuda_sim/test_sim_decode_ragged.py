"""Split-K decode over a ragged work list in the simulator, against the float64 reference.

Issue 43: each sequence gets its own partition count (a common chunk size), from a device work
list whose grid may be padded (a graph bucket sized for its worst case). Cases: ragged lengths
with partial last blocks, GQA, shuffled tables with garbage padding and NaN in every unused
cache slot (`sim_cases`), padded work items, padded rows of length 0, and a plan whose
partitioning changes between replays of the same launch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries, record_split_parts

import kernels
from kernels import reference
from kernels.cuda import decode, decode_policy, decode_split
from kernels.cuda.graph import DecodeGraphs
from kernels.cuda.plan import DecodePlan


def _reference(case, q, rows=slice(None)):
    return reference.paged_attention_decode(q[rows], case.key_cache, case.value_cache,
                                            case.block_tables[rows], case.seq_lens[rows],
                                            case.scale)


@pytest.mark.parametrize(("dtype", "block_size", "lens", "parts", "tol"), [
    (np.float16, 8, [150, 9, 261], [3, 1, 5], 1e-3),   # tensor cores, GQA 4, partial blocks
    (np.float32, 4, [70, 133], [1, 3], 1e-5),           # SIMT; one sequence not split
])
def test_per_sequence_partitions_match_reference(dtype, block_size, lens, parts, tol) -> None:
    rng = np.random.default_rng(5)
    case = make_case(rng, lens, num_kv_heads=2, block_size=block_size, head_dim=16, dtype=dtype)
    q = queries(rng, (len(lens), 8, 16), dtype)
    out = np.full(q.shape, np.nan, dtype=dtype)
    decode_split.paged_attention_decode_split(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale, out,
        parts=np.array(parts, np.int32))
    assert_close(out, _reference(case, q), tol)


def _small_thresholds(monkeypatch) -> None:
    """The policy at the simulator's sizes: 64-token splits, a pretend GPU of 8 slots."""
    monkeypatch.setattr(decode_policy, "MIN_PART_TOKENS", 64)
    monkeypatch.setattr(decode_policy, "MIN_SPLIT_TOKENS", 128)
    monkeypatch.setattr(decode, "resident_blocks", lambda spec: decode_policy.Occupancy(8, 8))


def test_public_decode_partitions_a_ragged_batch_by_a_common_chunk(monkeypatch) -> None:
    _small_thresholds(monkeypatch)
    calls = record_split_parts(monkeypatch)
    rng = np.random.default_rng(6)
    case = make_case(rng, [300, 40, 70], num_kv_heads=1, block_size=8, head_dim=16)
    q = queries(rng, (3, 4, 16), np.float16)
    out = kernels.paged_attention_decode(q, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, case.scale, backend="cuda")
    assert calls == [[5, 1, 1]]  # 64-token chunks: the long sequence alone is split
    assert_close(out, _reference(case, q), 1e-3)


def test_plan_replays_changing_partitions_in_one_grid(monkeypatch) -> None:
    """One plan (as a graph bucket holds it): its split grid is fixed at max_items; steps with
    other lengths re-partition through the work list only, rows padded to length 0 give
    zeros, and the design point's partitioning (lengths unknown on the host) still works."""
    _small_thresholds(monkeypatch)
    monkeypatch.setattr(decode, "resident_blocks", lambda spec: decode_policy.Occupancy(16, 16))
    rng = np.random.default_rng(7)
    case = make_case(rng, [260, 20, 130], num_kv_heads=1, block_size=8, head_dim=16,
                     pad_blocks=4)
    width = case.block_tables.shape[1]
    kc, vc = torch.from_numpy(case.key_cache), torch.from_numpy(case.value_cache)
    the_plan = DecodePlan(kc, 4, 4, width)
    assert the_plan.max_items >= 4 and the_plan.num_parts > 1
    tables = np.full((4, width), 10**6, np.int32)
    tables[:3] = case.block_tables
    q = queries(rng, (4, 4, 16), np.float16)
    steps = [[260, 20, 130, 0], [20, 260, 0, 0], [130, 130, 260, 20]]
    for lens in steps:
        real = [n for n in lens if n]
        tables[:len(real)] = case.block_tables[[[260, 20, 130].index(n) for n in real]]
        lens32 = np.array(lens, np.int32)
        assert the_plan.schedule(lens32)
        assert the_plan.parts is not None and int(the_plan.parts.max()) > 1
        out = torch.full((4, 4, 16), float("nan"), dtype=torch.float16)
        the_plan.launch(torch.from_numpy(q), kc, vc, torch.from_numpy(tables),
                        torch.from_numpy(lens32), case.scale, out)
        rows = slice(0, len(real))
        ref = reference.paged_attention_decode(q[rows], case.key_cache, case.value_cache,
                                               tables[rows], lens32[rows], case.scale)
        assert_close(out.numpy()[rows], ref, 1e-3)
        assert (out.numpy()[len(real):] == 0).all()
    the_plan.schedule(None)  # the design point: every sequence in num_parts partitions
    assert the_plan.split and the_plan.parts is None
    out = torch.full((4, 4, 16), float("nan"), dtype=torch.float16)
    lens32 = np.array(steps[-1], np.int32)
    the_plan.launch(torch.from_numpy(q), kc, vc, torch.from_numpy(tables),
                    torch.from_numpy(lens32), case.scale, out)
    ref = reference.paged_attention_decode(q, case.key_cache, case.value_cache, tables, lens32,
                                           case.scale)
    assert_close(out.numpy(), ref, 1e-3)


def test_graphs_pick_the_kernel_per_step(monkeypatch) -> None:
    """DecodeGraphs: a ragged step replays the bucket's split-K graph with its own
    partitions, a short step the one-pass graph of the same bucket (chosen from the host
    copy of the lengths); both match."""
    _small_thresholds(monkeypatch)
    rng = np.random.default_rng(8)
    case = make_case(rng, [280, 30, 12], num_kv_heads=1, block_size=8, head_dim=16)
    kc, vc = torch.from_numpy(case.key_cache), torch.from_numpy(case.value_cache)
    graphs = DecodeGraphs([kc], [vc], num_heads=4, max_blocks_per_seq=case.block_tables.shape[1],
                          scale=case.scale, buckets=(4,))
    q = torch.from_numpy(queries(rng, (3, 4, 16), np.float16))
    for rows, split in ((slice(0, 3), True), (slice(1, 3), False)):
        # lengths the kernels read (on the device in production) and their host copy
        graphs.prepare(torch.from_numpy(case.block_tables[rows]),
                       torch.from_numpy(case.seq_lens[rows]),
                       host_seq_lens=case.seq_lens[rows].tolist())
        assert graphs._current is not None and graphs._current[2] is split
        out = graphs.run(0, q[rows])
        assert_close(out.numpy(), _reference(case, q.numpy(), rows), 1e-3)
    assert {key[2] for key in graphs._graphs} == {True, False}
