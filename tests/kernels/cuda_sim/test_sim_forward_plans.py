"""The attention-only `Forward` path's execute (compute_node/forward.py) on the CUDA backend, in
the simulator: its writes and prefill group run through `prefill_path.StepKernels` (the plans
of kernels/cuda/prefill_plan.py, bound once for both layers), its decode group through the
pool's decode path. A mixed batch (one decode, one 3-token chunk after a cached prefix) over
two layers: every new K/V lands at its slot, and every output matches the float64 reference
over the written pool.
"""

from __future__ import annotations

import numpy as np
import torch
from sim_cases import assert_close, queries

import kernels
from compute_node.forward import ForwardBatch, LayerStep, SeqStep, execute, plan_attention
from compute_node.pool import KvPool, PoolGeometry
from compute_node.tables import NodeTable, SeqId
from kernels import reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 1, 16, 4, 12


def _unplanned(*args, **kwargs):
    raise AssertionError("the public per-call API was used: the step's plans were bypassed")


def test_forward_execute_through_the_step_plans_matches_the_reference(monkeypatch) -> None:
    rng = np.random.default_rng(45)
    geometry = PoolGeometry(2, KV_HEADS, HEAD_DIM, "float16", BLOCK, NUM_BLOCKS)
    pool = KvPool(geometry, torch.device("cpu"), cuda_graphs=True, max_context=32, backend="cuda")
    for cache in (*pool.key_caches, *pool.value_caches):
        cache.copy_(torch.from_numpy(queries(rng, tuple(cache.shape), np.float16)))
    tables = {SeqId("d"): NodeTable([7, 2, 9], 1, 10), SeqId("p"): NodeTable([4, 11], 1, 7)}
    # "d": 1 new token at position 9; "p": 3 new tokens at positions 4-6 after a 4-token prefix
    seqs = [SeqStep(SeqId("d"), 1, 10, 0), SeqStep(SeqId("p"), 3, 7, 1)]
    positions = {"d": [9], "p": [4, 5, 6]}
    slots = [tables[s.seq_id].block_table[p // BLOCK] * BLOCK + p % BLOCK for s in seqs for p in positions[s.seq_id]]
    layers = [LayerStep(layer, torch.from_numpy(queries(rng, (4, HEADS, HEAD_DIM), np.float16)),
                        torch.from_numpy(queries(rng, (4, KV_HEADS, HEAD_DIM), np.float16)),
                        torch.from_numpy(queries(rng, (4, KV_HEADS, HEAD_DIM), np.float16)))
              for layer in range(2)]
    batch = ForwardBatch("r1", [], seqs, layers, HEAD_DIM ** -0.5, 4, torch.tensor(slots, dtype=torch.int64))
    plan = plan_attention(batch, tables, geometry)
    monkeypatch.setattr(kernels, "write_slots", _unplanned)
    monkeypatch.setattr(kernels, "paged_prefill_attention", _unplanned)
    outputs, _ = execute(pool, batch, plan)
    assert pool.decode_path.stats.counts() == {"graph": 1}
    for layer, step in enumerate(layers):
        kc, vc = pool.key_caches[layer].numpy(), pool.value_caches[layer].numpy()
        got_k = kc[np.array(slots) // BLOCK, :, np.array(slots) % BLOCK]
        assert np.array_equal(got_k, step.key.numpy()) and np.array_equal(
            vc[np.array(slots) // BLOCK, :, np.array(slots) % BLOCK], step.value.numpy())
        out = outputs[layer].numpy()
        d_tables = np.array([[7, 2, 9]], dtype=np.int32)
        ref_d = reference.paged_attention_decode(step.query[:1].numpy(), kc, vc, d_tables,
                                                 np.array([10], np.int32), batch.scale)
        ref_p = reference.paged_prefill_attention(step.query[1:].numpy(), kc, vc, np.array([[4, 11]], np.int32),
                                                  np.array([7], np.int32), np.array([0, 3], np.int32), batch.scale)
        assert_close(out[:1], ref_d, 2e-3)
        assert_close(out[1:], ref_p, 2e-3)
