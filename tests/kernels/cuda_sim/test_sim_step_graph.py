"""Whole-step decode graphs (`compute_node/step_graph.py`) against the eager path, in the simulator.

Teacher forcing: three `ModelRunner`s over the same tiny random model and the same pool
contents — two replaying whole-step graphs (the policy's one-pass kernel; split-K forced), one
running the step eagerly (per-layer decode graphs) — get the same inputs every step (the graph
run's greedy picks) and must give the same picks, logprobs and K/V. The steps change batch
size across buckets (4, 8, 4, 1, 2), have ragged lengths crossing block boundaries, drop
sequences that finished, and include a mixed prefill + decode step that the whole-step path
must leave to the eager one. Under the
simulator a "graph" replays its launch (no capture): what this checks is everything around
the capture — static buffers shared by the buckets, padding rows that write and read nothing,
the per-bucket plans and their split-K schedule, outputs read from the static rows.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from compute_node.model import ModelRunner, SamplingParams, SeqWork
from compute_node.model.tiny import build_tiny_model
from compute_node.pool import KvPool
from compute_node.step_graph import StepGraphs

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 1, 32, 4, 40
CPU = torch.device("cpu")
PICK = SamplingParams(temperature=0.0, logprobs=2)


def _runner(model_dir, path: str) -> ModelRunner:
    """`path`: "eager" (per-layer decode graphs), "graph" (whole-step graphs, the policy's
    kernel: one-pass at these lengths) or "graph-split" (whole-step graphs, split-K forced)."""
    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS, device="cpu", max_model_len=32,
                         step_graphs=path != "eager")
    # the simulator's pool (CUDA kernels on CPU tensors), the same random "cached" K/V in all
    runner.pool = KvPool(runner.geometry, CPU, cuda_graphs=True, max_context=runner.max_model_len, backend="cuda")
    if path == "graph-split":
        runner._step_graphs = StepGraphs(runner.model, runner.pool, max_context=runner.max_model_len, decode_parts=2)
    gen = torch.Generator().manual_seed(0)
    for cache in (*runner.pool.key_caches, *runner.pool.value_caches):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return runner


def test_whole_step_graphs_match_the_eager_path_by_teacher_forcing(tmp_path) -> None:
    model_dir = build_tiny_model(
        tmp_path / "tiny", num_layers=1, hidden_size=64, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=128, vocab_size=300, dtype="float16", max_position_embeddings=32,
    )
    ids = list(range(NUM_BLOCKS))
    random.Random(5).shuffle(ids)
    tables = [ids[i * 8:(i + 1) * 8] for i in range(5)]   # shuffled, non-contiguous, 32 tokens each
    computed = [7, 2, 11, 4, 5]          # ragged cached lengths (K/V random, not prefilled)
    last = [10 + i for i in range(5)]    # each sequence's next input token
    runners = {path: _runner(model_dir, path) for path in ("graph", "graph-split", "eager")}
    # batches by sequence; None: the mixed step. s1 and s3 finish after step 2
    plan: list[list[int] | None] = [[0, 1, 2], [0, 1, 2, 3, 4], [0, 2, 4], [2], None, [0, 2]]
    decode_steps = 0
    for step in plan:
        if step is None:   # s4 decodes, s3 gets a 2-token chunk: eager on both runners
            work = [SeqWork("s4", [last[4]], computed[4], tables[4], PICK),
                    SeqWork("s3", [last[3], 17], computed[3], tables[3], PICK)]
            advance = {4: 1, 3: 2}
        else:
            work = [SeqWork(f"s{i}", [last[i]], computed[i], tables[i], PICK) for i in step]
            advance = {i: 1 for i in step}
            decode_steps += 1
        outs = {path: r.execute(work) for path, r in runners.items()}
        for path in ("graph", "graph-split"):
            for got, want in zip(outs[path], outs["eager"], strict=True):
                assert got is not None and want is not None
                assert got.logprob is not None and want.logprob is not None
                assert got.top_logprobs is not None and want.top_logprobs is not None
                assert got.token_id == want.token_id, (path, step, got, want)
                assert abs(got.logprob - want.logprob) < 2e-3, (path, step, got, want)
                assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        for (i, n), out in zip(advance.items(), outs["graph"], strict=True):
            assert out is not None
            computed[i] += n
            last[i] = out.token_id   # teacher forcing: both runners continue from the graph run's pick
    eager = runners["eager"].pool
    assert eager.decode_path.stats.counts() == {"graph": decode_steps + 1}
    for path, split in (("graph", False), ("graph-split", True)):
        graphs = runners[path]._step_graphs
        assert graphs is not None
        assert graphs.stats.counts() == {"graph": decode_steps}
        # buckets 4, 8, 1, 2 were replayed (the mixed step never reached them), with one kernel
        assert set(graphs._graphs) == {(b, split) for b in (1, 2, 4, 8)}
        pool = runners[path].pool
        # the whole-step path bypassed the per-layer decode graphs but for the mixed step's row
        assert pool.decode_path.stats.counts() == {"graph": 1}
        # the same K/V everywhere: padded rows wrote nothing, real rows wrote the same values
        for a, b in zip(pool.key_caches + pool.value_caches, eager.key_caches + eager.value_caches, strict=True):
            np.testing.assert_allclose(a.float().numpy(), b.float().numpy(), rtol=0, atol=2e-3)
        assert graphs.static_bytes() > 0
