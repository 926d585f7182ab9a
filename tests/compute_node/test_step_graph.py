"""Whole-step decode graphs (compute_node/step_graph.py) without a GPU: buckets, padding, replay inputs.

The captured forward needs a GPU (or Numba's simulator: tests/kernels/cuda_sim/
test_sim_step_graph.py compares it with the eager path by teacher forcing). Here the plans and
graphs are stand-ins that record what a replay would read, so the host side is checked alone:
which bucket a step replays, what its static rows hold (real rows copied in, padding rows that
write and attend nothing, stale rows of a larger earlier step cleared), the lengths the plan
schedules from, the fallback reasons, and that one load allows one replay.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from compute_node.model.batch import SeqWork, prepare_step
from compute_node.pool import KvPool, PoolGeometry
from compute_node.service.config import load_config
from compute_node.step_graph import StepGraphs

GEOMETRY = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4, num_blocks=64)
CONFIG = SimpleNamespace(num_heads=2, head_dim=8, hidden_size=16, vocab_size=50)


class _Plan:
    max_items, scratch = 0, None

    def __init__(self) -> None:
        self.scheduled: list[np.ndarray | None] = []

    def schedule(self, lens: np.ndarray | None) -> bool:
        self.scheduled.append(None if lens is None else lens.copy())
        return False


class _Graph:
    """Records the static rows of its bucket at each replay and writes recognisable outputs."""

    def __init__(self, graphs: StepGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket
        self.seen: list[dict[str, torch.Tensor]] = []

    def replay(self) -> None:
        g, b = self.graphs, self.bucket
        self.seen.append({name: getattr(g, name)[:b].clone() for name in ("input_ids", "positions", "slots", "lens",
                                                                        "tables")})
        g.logits[:b] = g.input_ids[:b, None].float()   # row r's logits say which token it ran
        g.hidden[:b] = g.positions[:b, None].half()


def _graphs(buckets: tuple[int, ...] = (1, 2, 4, 8), max_context: int = 32) -> StepGraphs:
    pool = KvPool(GEOMETRY, torch.device("cpu"), backend="cuda")
    model: Any = SimpleNamespace(config=CONFIG, dtype=torch.float16)
    graphs = StepGraphs(model, pool, max_context=max_context, buckets=buckets)
    graphs._plans = {b: _Plan() for b in graphs.buckets}
    graphs._graphs = {(b, False): _Graph(graphs, b) for b in graphs.buckets}
    return graphs


def _inputs(lens: list[int], token0: int = 10):
    """A pure-decode step: sequence i has lens[i] - 1 cached tokens and one new token."""
    work = [SeqWork(f"s{i}", [token0 + i], n - 1, list(range(8 * i, 8 * i + 8))) for i, n in enumerate(lens)]
    return prepare_step(work, GEOMETRY, vocab_size=CONFIG.vocab_size, max_model_len=32,
                        head_dim=CONFIG.head_dim, device=torch.device("cpu"))


def test_a_step_replays_its_bucket_with_padding_rows_that_touch_nothing() -> None:
    graphs = _graphs()
    assert graphs.load(_inputs([9, 3, 6, 2, 5]))   # 5 sequences: bucket 8
    hidden, logits = graphs.replay()
    seen = graphs._graphs[(8, False)].seen[-1]
    assert seen["input_ids"].tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    assert seen["positions"].tolist() == [8, 2, 5, 1, 4, 0, 0, 0]
    # slot = block * 4 + offset of the new token; padding rows -1 (the write kernel skips them)
    assert seen["slots"].tolist() == [2 * 4 + 0, 8 * 4 + 2, 17 * 4 + 1, 24 * 4 + 1, 33 * 4 + 0, -1, -1, -1]
    assert seen["lens"].tolist() == [9, 3, 6, 2, 5, 0, 0, 0]   # padding attends to nothing
    # each row's used blocks (the step's tables are as wide as its longest context, 3 blocks)
    assert seen["tables"][:5, :3].tolist() == [[0, 1, 2], [8, 0, 0], [16, 17, 0], [24, 0, 0], [32, 33, 0]]
    assert graphs._plans[8].scheduled[-1].tolist() == [9, 3, 6, 2, 5, 0, 0, 0]
    # the returned views are the step's rows only
    assert logits.shape == (5, CONFIG.vocab_size) and logits[:, 0].tolist() == [10, 11, 12, 13, 14]
    assert hidden.shape == (5, CONFIG.hidden_size) and hidden[:, 0].tolist() == [8, 2, 5, 1, 4]


def test_slots_match_prepare_step_and_a_smaller_step_clears_the_larger_ones_rows() -> None:
    graphs = _graphs()
    big = _inputs([9, 3, 6, 2])
    assert graphs.load(big)
    graphs.replay()
    assert graphs._graphs[(4, False)].seen[-1]["slots"].tolist() == big.meta.slot_mapping.tolist()
    assert graphs.load(_inputs([7, 5, 4], token0=20))   # 3 sequences: bucket 4 again, row 3 padded now
    graphs.replay()
    seen = graphs._graphs[(4, False)].seen[-1]
    assert seen["input_ids"].tolist() == [20, 21, 22, 0]
    assert seen["slots"][3].item() == -1 and seen["lens"][3].item() == 0
    assert graphs.load(_inputs([12]))                     # 1 sequence: bucket 1
    graphs.replay()
    assert [len(graphs._graphs[(b, False)].seen) for b in (1, 2, 4, 8)] == [1, 0, 2, 0]
    assert graphs.stats.counts() == {"graph": 3}


def test_steps_that_do_not_fit_are_counted_and_load_nothing() -> None:
    graphs = _graphs(buckets=(1, 2), max_context=8)      # 2 blocks of 4 per sequence
    assert not graphs.load(_inputs([3, 4, 2]))            # 3 sequences > the largest bucket
    assert not graphs.load(_inputs([9]))                  # 3 blocks > 2
    with pytest.raises(RuntimeError, match="without a loaded step"):
        graphs.replay()
    assert graphs.load(_inputs([8, 1]))
    graphs.replay()
    with pytest.raises(RuntimeError, match="without a loaded step"):   # one replay per load
        graphs.replay()
    assert graphs.stats.counts() == {"graph": 1, "fallback_batch": 1, "fallback_table_width": 1}


def test_buffers_are_sized_once_for_the_largest_bucket() -> None:
    graphs = _graphs(buckets=(4, 1, 16), max_context=32)
    assert graphs.buckets == [1, 4, 16]
    assert graphs.tables.shape == (16, 8) and graphs.logits.shape == (16, CONFIG.vocab_size)
    assert graphs.slots.tolist() == [-1] * 16
    assert [graphs.bucket_for(n) for n in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, None]
    model: Any = SimpleNamespace(config=CONFIG, dtype=torch.float16)
    with pytest.raises(ValueError, match="cuda backend"):
        StepGraphs(model, KvPool(GEOMETRY, torch.device("cpu")), max_context=32)


def test_config_switch_is_off_by_default(monkeypatch) -> None:
    assert load_config().step_graphs is False
    monkeypatch.setenv("PAGEDKV_CN_STEP_GRAPHS", "true")
    assert load_config().step_graphs is True


def test_the_runner_ignores_the_switch_on_the_cpu_backend(tmp_path) -> None:
    """`step_graphs=True` on a CPU pool: steps run as without it (the CPU has no graphs)."""
    from compute_node.model import ModelRunner, SamplingParams
    from compute_node.model.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                                 head_dim=16, intermediate_size=64, vocab_size=300, max_position_embeddings=32)
    greedy = SamplingParams(temperature=0.0)
    picks = []
    for on in (True, False):
        runner = ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu", step_graphs=on)
        first = runner.execute([SeqWork("a", [5, 6, 7], 0, [3, 1], greedy)])[0]
        assert first is not None
        second = runner.execute([SeqWork("a", [first.token_id], 3, [3, 1], greedy)])[0]
        assert second is not None and runner._step_graphs is None
        picks.append((first.token_id, second.token_id))
    assert picks[0] == picks[1]
