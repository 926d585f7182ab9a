"""DecodePlan and DecodeGraphs in the simulator (where a graph replay is a plain launch).

What is checked here is everything but the CUDA graph itself: the static per-bucket buffers,
rows padded with length 0, narrower tables, per-layer caches, and a bucket whose plan splits
(partition count fixed by capacity, partitions sized by each sequence's length). The capture
and replay on a GPU are checked by bench/gpu_check.sh.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries

from kernels import KernelInputError, reference
from kernels.cuda import decode, decode_policy
from kernels.cuda.graph import DecodeGraphs


def test_graphs_per_bucket_and_layer(monkeypatch) -> None:
    # bucket 1 splits at its design point (thresholds scaled to the simulator's sizes)
    monkeypatch.setattr(decode, "resident_blocks", lambda spec: decode_policy.Occupancy(8, 8))
    monkeypatch.setattr(decode_policy, "MIN_SPLIT_TOKENS", 64)
    monkeypatch.setattr(decode_policy, "MIN_PART_TOKENS", 64)
    rng = np.random.default_rng(0)
    first = make_case(rng, [40, 9, 23], num_kv_heads=1, block_size=8, head_dim=16, pad_blocks=30)
    second = copy.deepcopy(first)  # a second layer: same block ids, other values (NaN kept)
    for cache in (second.key_cache, second.value_cache):
        used = ~np.isnan(cache)
        cache[used] = rng.standard_normal(int(used.sum())).astype(cache.dtype)
    layers = [first, second]
    tables = first.block_tables
    kc = [torch.from_numpy(c.key_cache) for c in layers]
    vc = [torch.from_numpy(c.value_cache) for c in layers]
    width = tables.shape[1] + 2  # tables passed to prepare may be narrower
    graphs = DecodeGraphs(kc, vc, num_heads=4, max_blocks_per_seq=width, scale=0.25,
                          buckets=(1, 4))
    lens = layers[0].seq_lens
    assert graphs.prepare(torch.from_numpy(tables), torch.from_numpy(lens)) == 4
    plan = graphs._bucket(4).plan
    assert plan.num_parts == 1
    for layer, case in enumerate(layers):
        q = torch.from_numpy(queries(rng, (3, 4, 16), np.float16))
        out = graphs.run(layer, q)
        assert out.shape == (3, 4, 16)
        ref = reference.paged_attention_decode(q, case.key_cache, case.value_cache, tables,
                                               lens, 0.25)
        assert_close(out.numpy(), ref, 1e-3)
    assert (graphs._bucket(4).out[3] == 0).all()  # the padded row: length 0, zeros
    # one sequence: bucket 1, whose plan splits (4 * 8 tokens of capacity / 32 per part)
    assert graphs.prepare(torch.from_numpy(tables[1:2, :3]), torch.from_numpy(lens[1:2])) == 1
    assert graphs._bucket(1).plan.num_parts > 1
    q = torch.from_numpy(queries(rng, (1, 4, 16), np.float16))
    into = torch.empty((1, 4, 16), dtype=torch.float16)
    assert graphs.run(1, q, out=into) is into
    ref = reference.paged_attention_decode(q, layers[1].key_cache, layers[1].value_cache,
                                           tables[1:2], lens[1:2], 0.25)
    assert_close(into.numpy(), ref, 1e-3)


def test_graphs_reject_bad_use() -> None:
    rng = np.random.default_rng(1)
    case = make_case(rng, [5], num_kv_heads=1, block_size=4, head_dim=16)
    kc, vc = torch.from_numpy(case.key_cache), torch.from_numpy(case.value_cache)
    graphs = DecodeGraphs([kc], [vc], num_heads=2, max_blocks_per_seq=3, scale=1.0, buckets=(2,))
    q = torch.zeros((1, 2, 16), dtype=torch.float16)
    with pytest.raises(KernelInputError, match="prepare"):
        graphs.run(0, q)
    with pytest.raises(KernelInputError, match="largest bucket"):
        graphs.prepare(torch.zeros((3, 2), dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="block_tables"):
        graphs.prepare(torch.zeros((1, 4), dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="host_seq_lens"):
        graphs.prepare(torch.from_numpy(case.block_tables), torch.from_numpy(case.seq_lens),
                       host_seq_lens=[5, 5])
    graphs.prepare(torch.from_numpy(case.block_tables), torch.from_numpy(case.seq_lens))
    with pytest.raises(KernelInputError, match="query"):
        graphs.run(0, torch.zeros((2, 2, 16), dtype=torch.float16))
