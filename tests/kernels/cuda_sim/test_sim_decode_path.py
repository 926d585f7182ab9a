"""The compute node's decode through `DecodeGraphs` in the simulator (compute_node/decode_path.py).

Numba's simulator runs the CUDA kernels on CPU torch tensors, so the pool here is a CPU pool
on the "cuda" backend (torch has no CUDA tensors without a GPU); a graph replay is a plain
launch of the captured plan. What this checks is the node's use of the graphs: one `prepare`
per step, per-layer replays into the real output rows (layer 1's replay must not overwrite
layer 0's result), tables narrower than the graphs' width, a padded bucket — against the
direct `pool.decode` launch and the float64 reference, and through the real `ModelRunner`.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch
from sim_cases import assert_close, make_case, queries

from compute_node.decode_path import StepShape
from compute_node.model import ModelRunner, SamplingParams, SeqWork
from compute_node.model.attention import AttentionMetadata, paged_attention
from compute_node.model.tiny import build_tiny_model
from compute_node.pool import KvPool, PoolGeometry
from kernels import reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 1, 32, 4
CPU = torch.device("cpu")


def _sim_pool(geometry: PoolGeometry, graphs: bool, max_context: int) -> KvPool:
    return KvPool(geometry, CPU, cuda_graphs=graphs, max_context=max_context, backend="cuda")


def test_attention_decode_through_graphs_matches_direct_and_reference() -> None:
    rng = np.random.default_rng(7)
    lens = [13, 5, 9]  # ragged, partial last blocks; shuffled tables with garbage padding
    first = make_case(rng, lens, num_kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM)
    second = copy.deepcopy(first)  # layer 1: the same block ids, other values
    for cache in (second.key_cache, second.value_cache):
        used = ~np.isnan(cache)
        cache[used] = rng.standard_normal(int(used.sum())).astype(cache.dtype)
    layers = [first, second]
    num_blocks = first.key_cache.shape[0]
    geometry = PoolGeometry(2, KV_HEADS, HEAD_DIM, "float16", BLOCK, num_blocks)
    tables = torch.from_numpy(first.block_tables)
    seq_lens = torch.from_numpy(first.seq_lens)
    # the graphs hold 6 blocks per sequence; this step's tables are narrower (4 + 1 padding)
    pools = {graphs: _sim_pool(geometry, graphs, max_context=6 * BLOCK) for graphs in (True, False)}
    for pool in pools.values():
        for layer, case in enumerate(layers):
            pool.key_caches[layer].copy_(torch.from_numpy(case.key_cache))
            pool.value_caches[layer].copy_(torch.from_numpy(case.value_cache))
    # this step's new token of each sequence sits at position len - 1
    last = np.asarray(lens) - 1
    slots = torch.from_numpy(first.block_tables[np.arange(3), last // BLOCK].astype(np.int64) * BLOCK + last % BLOCK)
    q = [torch.from_numpy(queries(rng, (3, HEADS, HEAD_DIM), np.float16)) for _ in layers]
    k = [torch.from_numpy(queries(rng, (3, KV_HEADS, HEAD_DIM), np.float16) / 3) for _ in layers]
    v = [torch.from_numpy(queries(rng, (3, KV_HEADS, HEAD_DIM), np.float16) / 3) for _ in layers]
    shape = StepShape(HEADS, torch.float16, first.scale)
    metas, outs = {}, {True: [], False: []}
    for graphs, pool in pools.items():
        metas[graphs] = AttentionMetadata(slots, 3, tables, seq_lens, None, None, None, first.scale)
        metas[graphs].decode = pool.begin_decode(tables, seq_lens, shape)
        assert metas[graphs].decode.graphed is graphs
    for layer in range(2):  # interleaved: launches of one kernel with two grids (3 rows, bucket 4)
        for graphs in (False, True):
            outs[graphs].append(paged_attention(pools[graphs], layer, q[layer], k[layer], v[layer], metas[graphs]))
    graphed = pools[True]
    assert graphed.decode_path.stats.counts() == {"graph": 1}
    assert graphed.decode_path.static_bytes() > 0
    for layer in range(2):
        kc, vc = graphed.key_caches[layer].numpy(), graphed.value_caches[layer].numpy()
        ref = reference.paged_attention_decode(q[layer], kc, vc, first.block_tables, first.seq_lens, first.scale)
        assert_close(outs[True][layer].numpy(), ref, 1e-3)
        assert_close(outs[False][layer].numpy(), ref, 1e-3)
        assert_close(outs[True][layer].numpy(), outs[False][layer].numpy().astype(np.float64), 2e-3)


def _run(runner: ModelRunner, cached: list[int], tables: list[list[int]]):
    """Two decode steps over `cached` tokens already in the pool: a greedy one, then one whose
    logits are returned (the simulator is slow: the prompts' K/V are random, not prefilled)."""
    greedy = SamplingParams(temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    for cache in (*runner.pool.key_caches, *runner.pool.value_caches):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    out = runner.execute([SeqWork(f"s{i}", [7 + i], n, t, greedy) for i, (n, t) in enumerate(zip(cached, tables))])
    tokens = [o.token_id for o in out]
    step = [SeqWork(f"s{i}", [tokens[i]], n + 1, t) for i, (n, t) in enumerate(zip(cached, tables))]
    return tokens, runner.debug_forward(step).logits


def test_model_runner_decodes_through_graphs(tmp_path) -> None:
    # One layer: per-layer replays into their own output rows are the test above's (two
    # layers); here it is the runner's use of the graphs, at half the simulator time (issue 24).
    model_dir = build_tiny_model(
        tmp_path / "tiny", num_layers=1, hidden_size=64, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=128, vocab_size=300, dtype="float16", max_position_embeddings=32,
    )
    ids = list(range(12))
    random.Random(3).shuffle(ids)
    tables = [ids[0:4], ids[4:7], ids[7:12]]   # shuffled, non-contiguous
    cached = [7, 2, 4]   # the second step crosses into a new block for two of them
    results = {}
    for graphs in (True, False):
        runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=12, device="cpu", max_model_len=24)
        # the simulator's pool in place of the CPU one (same geometry, CUDA kernels on CPU tensors)
        runner.pool = _sim_pool(runner.geometry, graphs, max_context=runner.max_model_len)
        results[graphs] = _run(runner, cached, tables)
        path = runner.pool.decode_path
        assert path.stats.counts() == {"graph": 2 if graphs else 0}   # the two decode steps
    (tok_g, logits_g), (tok_d, logits_d) = results[True], results[False]
    assert tok_g == tok_d
    err = (logits_g - logits_d).abs().max() / logits_d.abs().max()
    assert err < 2e-3, err
