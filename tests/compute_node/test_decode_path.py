"""Decode through CUDA graphs or the direct launch (compute_node/decode_path.py), without a GPU.

The rule is a pure function; the pool's wiring is checked with a stand-in for
`kernels.DecodeGraphs` (the real one needs a GPU or Numba's simulator: its numerics are checked
in tests/kernels/cuda_sim/test_sim_decode_path.py and on a GPU by bench/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from compute_node.decode_path import GraphLimits, StaleDecodeStep, StepShape, graph_fallback
from compute_node.model.attention import AttentionMetadata, UnboundDecode, paged_attention
from compute_node.pool import KvPool, PoolGeometry
from compute_node.service.config import load_config
from compute_node.service.metrics import NodeMetrics

LIMITS = GraphLimits(largest_bucket=256, max_blocks_per_seq=8)
SHAPE = StepShape(num_heads=4, dtype=torch.float16, scale=0.125)
GEOMETRY = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, num_blocks=32)


@pytest.mark.parametrize(
    ("num_seqs", "width", "bound", "shape", "expected"),
    [
        (1, 1, None, SHAPE, None),                                    # unbound: the first step binds
        (256, 8, SHAPE, SHAPE, None),                                 # the largest bucket, the widest table
        (257, 1, SHAPE, SHAPE, "batch"),
        (3, 9, SHAPE, SHAPE, "table_width"),
        (3, 2, SHAPE, SHAPE._replace(dtype=torch.float32), "dtype"),
        (3, 2, SHAPE, SHAPE._replace(num_heads=8), "num_heads"),
        (3, 2, SHAPE, SHAPE._replace(scale=0.5), "scale"),
        (300, 20, SHAPE, SHAPE._replace(dtype=torch.float32), "batch"),  # the first reason wins
        (3, 2, None, SHAPE._replace(dtype=torch.float32), None),
    ],
)
def test_fallback_rule(num_seqs, width, bound, shape, expected) -> None:
    assert graph_fallback(LIMITS, bound, num_seqs, width, shape) == expected


class FakeGraphs:
    """Records what the pool asks of `kernels.DecodeGraphs`; 'attention' is query * (layer + 1)
    written into a static buffer, as the real one does, then copied out."""

    instances: list[FakeGraphs] = []

    def __init__(self, key_caches, value_caches, num_heads, max_blocks_per_seq, scale, dtype=None) -> None:
        self.args = (num_heads, max_blocks_per_seq, scale, dtype)
        self.prepared: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_lens: list[object] = []   # host_seq_lens of each prepare
        self.static = torch.zeros(0)
        FakeGraphs.instances.append(self)

    def prepare(self, block_tables, seq_lens, *, host_seq_lens=None) -> int:
        self.prepared.append((block_tables, seq_lens))
        self.host_lens.append(host_seq_lens)
        return 4

    def run(self, layer, query, out=None):
        self.static = query * (layer + 1)
        if out is not None:
            out.copy_(self.static)
            return out
        return self.static

    def static_bytes(self) -> int:
        return 1234


@pytest.fixture
def graphed_pool(monkeypatch) -> KvPool:
    FakeGraphs.instances = []
    monkeypatch.setattr(kernels, "DecodeGraphs", FakeGraphs, raising=False)
    return KvPool(GEOMETRY, torch.device("cpu"), cuda_graphs=True, max_context=20, backend="cuda")


def _tables(num_seqs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((num_seqs, width), dtype=torch.int32), torch.ones(num_seqs, dtype=torch.int32)


def test_cpu_pool_launches_directly_and_counts_nothing() -> None:
    pool = KvPool(GEOMETRY, torch.device("cpu"), cuda_graphs=True)
    assert not pool.decode_path.enabled
    tables, lens = torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    step = pool.begin_decode(tables, lens, SHAPE)
    assert not step.graphed
    q = torch.randn((1, 4, 16), dtype=torch.float16)
    assert torch.equal(step.run(1, q), pool.decode(1, q, tables, lens, SHAPE.scale))
    assert pool.decode_path.stats.counts() == {"graph": 0} and pool.decode_path.static_bytes() == 0


def test_graphed_steps_prepare_once_and_copy_out(graphed_pool: KvPool) -> None:
    path = graphed_pool.decode_path
    assert path.enabled and path.limits == GraphLimits(256, 5)   # 20 tokens of context in blocks of 4
    step = graphed_pool.begin_decode(*_tables(3, 2), SHAPE)
    assert step.graphed
    (graphs,) = FakeGraphs.instances
    assert graphs.args == (4, 5, 0.125, torch.float16) and len(graphs.prepared) == 1
    q = torch.randn((3, 4, 16), dtype=torch.float16)
    outs = [step.run(layer, q) for layer in range(2)]
    assert len(graphs.prepared) == 1                              # once per step, not per layer
    assert torch.equal(outs[0], q) and torch.equal(outs[1], 2 * q)  # layer 0 not overwritten by layer 1
    assert all(o.data_ptr() != graphs.static.data_ptr() for o in outs)
    into = torch.empty_like(q)
    assert step.run(0, q, out=into) is into
    assert path.static_bytes() == 1234


def test_fallbacks_are_counted_by_reason(graphed_pool: KvPool) -> None:
    path = graphed_pool.decode_path
    assert graphed_pool.begin_decode(*_tables(2, 1), SHAPE).graphed    # binds the graphs to SHAPE
    assert not graphed_pool.begin_decode(*_tables(257, 1), SHAPE).graphed
    assert not graphed_pool.begin_decode(*_tables(2, 6), SHAPE).graphed
    assert not graphed_pool.begin_decode(*_tables(2, 1), SHAPE._replace(num_heads=2)).graphed
    assert not graphed_pool.begin_decode(*_tables(2, 1), SHAPE._replace(num_heads=2)).graphed
    assert graphed_pool.begin_decode(*_tables(5, 5), SHAPE).graphed
    assert path.stats.counts() == {"graph": 2, "fallback_batch": 1, "fallback_table_width": 1,
                                   "fallback_num_heads": 2}
    assert len(FakeGraphs.instances) == 1                          # one DecodeGraphs per pool


def test_a_graphed_step_cannot_run_after_the_next_began(graphed_pool: KvPool) -> None:
    first = graphed_pool.begin_decode(*_tables(2, 1), SHAPE)
    graphed_pool.begin_decode(*_tables(1, 1), SHAPE)
    with pytest.raises(StaleDecodeStep):
        first.run(0, torch.zeros((2, 4, 16), dtype=torch.float16))


def test_attention_runs_the_bound_step_into_its_rows(graphed_pool: KvPool) -> None:
    """The model path: decode rows [0, 2) through the step, written into the real output."""
    q = torch.randn((2, 4, 16), dtype=torch.float16)
    kv = torch.zeros((2, 2, 16), dtype=torch.float16)
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
    # The pool writes K/V on the CPU backend here (no simulator in this process).
    graphed_pool.backend = "cpu"
    meta = AttentionMetadata(torch.tensor([0, 4]), 2, tables, lens, None, None, None, 0.125)
    with pytest.raises(UnboundDecode):
        paged_attention(graphed_pool, 1, q, kv, kv, meta)
    meta.decode = graphed_pool.begin_decode(tables, lens, SHAPE)
    assert torch.equal(paged_attention(graphed_pool, 1, q, kv, kv, meta), 2 * q)


def test_config_switch_and_metrics(monkeypatch) -> None:
    assert load_config().cuda_graphs is True
    monkeypatch.setenv("PAGEDKV_CN_CUDA_GRAPHS", "false")
    assert load_config().cuda_graphs is False
    metrics = NodeMetrics()
    metrics.watch_decode_paths(lambda: ({"graph": 3, "fallback_batch": 1}, 4096))
    text = metrics.render().decode()
    assert 'pagedkv_cn_decode_steps_total{path="graph"} 3.0' in text
    assert 'pagedkv_cn_decode_steps_total{path="fallback_batch"} 1.0' in text
    assert "pagedkv_cn_decode_graph_bytes 4096.0" in text


def test_host_lengths_reach_the_graphs(graphed_pool: KvPool) -> None:
    """The graphs partition a step from the host copy of its lengths (issue 43): it is passed
    through untouched; a caller without one passes None (the bucket's design point)."""
    tables, lens = _tables(3, 2)
    host = lens.numpy().copy()
    graphed_pool.begin_decode(tables, lens, SHAPE, host_seq_lens=host)
    graphed_pool.begin_decode(tables, lens, SHAPE)
    (graphs,) = FakeGraphs.instances
    assert graphs.host_lens[0] is host and graphs.host_lens[1] is None


def test_model_step_inputs_carry_host_decode_lengths() -> None:
    from compute_node.model import SeqWork
    from compute_node.model.batch import prepare_step

    batch = [SeqWork("p", [1, 2, 3], 0, [0]), SeqWork("a", [4], 9, [1, 2, 3]), SeqWork("b", [5], 2, [4])]
    inputs = prepare_step(batch, GEOMETRY, vocab_size=10, max_model_len=20, head_dim=16, device=torch.device("cpu"))
    host, dev = inputs.decode_seq_lens_host, inputs.meta.decode_seq_lens
    assert host is not None and dev is not None
    assert host.tolist() == [10, 3] == dev.tolist()
    only_prefill = prepare_step(batch[:1], GEOMETRY, vocab_size=10, max_model_len=20, head_dim=16,
                                device=torch.device("cpu"))
    assert only_prefill.decode_seq_lens_host is None


def test_forward_passes_its_host_lengths(graphed_pool: KvPool) -> None:
    """The attention-only Forward path: the plan's lengths (built on the host) go with the step."""
    from compute_node.forward import AttentionPlan, ForwardBatch, LayerStep, execute

    graphed_pool.backend = "cpu"   # K/V writes on the CPU kernels (no simulator in this process)
    q = torch.randn((2, 4, 16), dtype=torch.float16)
    kv = torch.zeros((2, 2, 16), dtype=torch.float16)
    batch = ForwardBatch("r", [], [], [LayerStep(0, q, kv, kv)], 0.125, 2, torch.tensor([0, 5]))
    lens = torch.tensor([1, 2], dtype=torch.int32)
    plan = AttentionPlan(torch.tensor([0, 1]), torch.tensor([[0], [1]], dtype=torch.int32), lens,
                         None, None, None, None, 0)
    (out,), _ = execute(graphed_pool, batch, plan)
    (graphs,) = FakeGraphs.instances
    assert torch.equal(torch.as_tensor(graphs.host_lens[0]), lens) and torch.equal(out, q)


def test_host_lengths_reach_the_direct_launch(graphed_pool: KvPool, monkeypatch) -> None:
    """A step that falls back launches per layer with device lengths; the host copy goes with
    them, so the split policy partitions from the real lengths (issue 43), not the capacity."""
    seen: list[object] = []

    def launch(query, key_cache, value_cache, block_tables, seq_lens, scale, out=None, backend="auto", *,
               host_seq_lens=None):
        seen.append(host_seq_lens)
        return query

    monkeypatch.setattr(kernels, "paged_attention_decode", launch)
    tables, lens = _tables(3, 9)                            # wider than the graphs hold: fallback
    host = lens.numpy().copy()
    q = torch.randn((3, 4, 16), dtype=torch.float16)
    graphed_pool.begin_decode(tables, lens, SHAPE, host_seq_lens=host).run(0, q)
    graphed_pool.begin_decode(tables, lens, SHAPE).run(1, q)
    assert seen[0] is host and seen[1] is None
    assert graphed_pool.decode_path.stats.counts() == {"graph": 0, "fallback_table_width": 2}


def test_the_cpu_backend_checks_and_ignores_host_lengths() -> None:
    pool = KvPool(GEOMETRY, torch.device("cpu"), cuda_graphs=False)
    tables, lens = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)
    q = torch.randn((2, 4, 16), dtype=torch.float16)
    step = pool.begin_decode(tables, lens, SHAPE, host_seq_lens=lens.numpy().copy())
    assert step.host_seq_lens is None                      # not checked again at every layer
    assert torch.equal(step.run(1, q), pool.decode(1, q, tables, lens, SHAPE.scale))
    good = pool.decode(1, q, tables, lens, SHAPE.scale, host_seq_lens=lens.numpy().copy())
    assert torch.equal(good, pool.decode(1, q, tables, lens, SHAPE.scale))
    for bad in ([6], [6, 4], [6, 0], [6, 9]):   # short, not the device lengths, < 1, > capacity
        with pytest.raises(kernels.KernelInputError, match="host_seq_lens"):
            pool.decode(1, q, tables, lens, SHAPE.scale, host_seq_lens=torch.tensor(bad))
