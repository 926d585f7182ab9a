"""The node's graphed decode partitions each step from the host lengths (issue 43), in the simulator.

The node builds every decode step's lengths on the host and copies them to the device; it
passes both to `KvPool.begin_decode`, and `DecodeGraphs.prepare` partitions the step from the
host copy (`decode_policy`: no split below the threshold, a ragged batch cut by a common chunk
size). On a GPU the device copy cannot be read without a synchronisation; here, where the
"device" tensors are CPU tensors, `DecodeGraphs` is made to treat torch tensors as device
memory (as CUDA tensors are), so the partitions can only come from `host_seq_lens`. Without
them the bucket's design point would apply (every row split alike at the table capacity),
which the controls below show differs. The policy runs at the simulator's sizes (64-token
partitions, no split below 128 tokens, a pretend GPU of 8 resident blocks), as in
`test_sim_decode_ragged.py`; outputs are checked against the float64 reference, and through
the real `ModelRunner` against its direct launch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries

from compute_node.decode_path import StepShape
from compute_node.model import ModelRunner, SeqWork
from compute_node.model.tiny import build_tiny_model
from compute_node.pool import KvPool, PoolGeometry
from kernels import reference
from kernels.cuda import decode, decode_policy, graph

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 16, 8
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def small_policy_device_lengths(monkeypatch) -> None:
    monkeypatch.setattr(decode_policy, "MIN_PART_TOKENS", 64)
    monkeypatch.setattr(decode_policy, "MIN_SPLIT_TOKENS", 128)
    monkeypatch.setattr(decode, "resident_blocks", lambda spec: decode_policy.Occupancy(8, 8))

    def device_lengths_unreadable(x):  # a torch tensor stands for a CUDA tensor here
        return None if isinstance(x, torch.Tensor) else np.asarray(x)

    monkeypatch.setattr(graph, "to_host_numpy", device_lengths_unreadable)


def _plan(pool: KvPool, num_seqs: int):
    graphs = pool.decode_path._graphs
    return graphs._bucket(graphs.bucket_for(num_seqs)).plan


def _expected_parts(plan, lens: list[int]) -> np.ndarray | None:
    padded = np.zeros(plan.batch, np.int64)
    padded[:len(lens)] = lens
    return decode_policy.split_parts(padded, plan.heads_grid, plan.occupancy, plan.max_items)


def test_graphed_steps_are_partitioned_from_host_lengths() -> None:
    rng = np.random.default_rng(11)
    lens = [300, 40, 70]
    case = make_case(rng, lens, num_kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM)
    width = case.block_tables.shape[1]
    geometry = PoolGeometry(1, KV_HEADS, HEAD_DIM, "float16", BLOCK, case.key_cache.shape[0])
    pool = KvPool(geometry, CPU, cuda_graphs=True, max_context=width * BLOCK, backend="cuda")
    pool.key_caches[0].copy_(torch.from_numpy(case.key_cache))
    pool.value_caches[0].copy_(torch.from_numpy(case.value_cache))
    shape = StepShape(HEADS, torch.float16, float(case.scale))
    q = queries(rng, (3, HEADS, HEAD_DIM), np.float16)
    # (rows of the case, split-K expected): ragged with one long sequence; all below 128 tokens
    for rows, split in (([0, 1, 2], True), ([1, 2], False)):
        tables = case.block_tables[rows]
        step_lens = case.seq_lens[rows]
        # control: the same step without host lengths runs the bucket's design point, which
        # here is the other kernel (bucket 4 at capacity fills half the slots: one pass;
        # bucket 2 does not: every row split alike)
        pool.begin_decode(torch.from_numpy(tables), torch.from_numpy(step_lens), shape)
        plan = _plan(pool, len(rows))
        assert plan.split is not split and plan.parts is None
        step = pool.begin_decode(torch.from_numpy(tables), torch.from_numpy(step_lens), shape,
                                 host_seq_lens=step_lens)
        assert step.graphed and plan.split is split
        expected = _expected_parts(plan, step_lens.tolist())
        if split:
            assert expected is not None and plan.parts is not None
            assert plan.parts.tolist() == expected.tolist()
            assert plan.parts[0] > plan.parts[1] == plan.parts[2] == 1  # the long one alone
        else:
            assert expected is None
        out = step.run(0, torch.from_numpy(q[: len(rows)]))
        ref = reference.paged_attention_decode(q[: len(rows)], case.key_cache, case.value_cache,
                                               tables, step_lens, case.scale)
        assert_close(out.numpy(), ref, 1e-3)
    assert pool.decode_path.stats.counts() == {"graph": 4}


def test_model_runner_passes_its_host_lengths(tmp_path, monkeypatch) -> None:
    """The runner's step: the long sequence alone is split, from the lengths it built on the
    host, and the logits equal the direct launch's (one layer: the simulator is slow)."""
    model_dir = build_tiny_model(
        tmp_path / "tiny", num_layers=1, hidden_size=64, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, intermediate_size=128, vocab_size=300, dtype="float16",
        max_position_embeddings=256,
    )
    cached = [200, 5, 20]
    used = [-(-(n + 1) // BLOCK) for n in cached]
    ids = np.random.default_rng(4).permutation(sum(used)).tolist()
    tables = [ids[sum(used[:i]):sum(used[:i + 1])] for i in range(3)]
    seen = []
    prepare = graph.DecodeGraphs.prepare

    def spy(self, block_tables, seq_lens, *, host_seq_lens=None):
        seen.append(None if host_seq_lens is None else np.asarray(host_seq_lens).tolist())
        return prepare(self, block_tables, seq_lens, host_seq_lens=host_seq_lens)

    monkeypatch.setattr(graph.DecodeGraphs, "prepare", spy)
    logits = {}
    for graphs in (True, False):
        runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=sum(used), device="cpu",
                             max_model_len=224)
        runner.pool = KvPool(runner.geometry, CPU, cuda_graphs=graphs, max_context=224, backend="cuda")
        gen = torch.Generator().manual_seed(0)
        for cache in (*runner.pool.key_caches, *runner.pool.value_caches):
            cache.copy_(torch.randn(cache.shape, generator=gen))
        step = [SeqWork(f"s{i}", [7 + i], n, t) for i, (n, t) in enumerate(zip(cached, tables))]
        logits[graphs] = runner.debug_forward(step).logits
        if graphs:
            plan = _plan(runner.pool, 3)
            assert plan.split and plan.parts is not None
            expected = _expected_parts(plan, [n + 1 for n in cached])
            assert expected is not None and plan.parts.tolist() == expected.tolist()
            assert plan.parts[0] > 1 and plan.parts[1] == plan.parts[2] == 1
    assert seen == [[n + 1 for n in cached]]
    err = (logits[True] - logits[False]).abs().max() / logits[False].abs().max()
    assert err < 2e-3, err
