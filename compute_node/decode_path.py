"""Decode attention of one step over a `KvPool`: replayed from CUDA graphs, or launched directly.

Why graphs: a decode step runs attention once per layer for the same batch, and on a GPU each
direct launch pays Python for validation, dispatch and argument conversion (tens of µs, see
bench/gpu_check.py "host path") on top of a kernel that, for a small batch, takes about as
long. `kernels.DecodeGraphs` replays one captured CUDA graph per (layer, batch-size bucket)
instead: one copy of the step's tables and lengths (`prepare`), then per layer one query copy
and one replay.

Host lengths: the caller passes the step's lengths twice, on the device (what the kernels
read) and as the host array it built them from (`host_seq_lens`). From the host copy
`prepare` chooses each step's kernel and partitions (`kernels/cuda/decode_policy.py`): no
split below 1024 tokens, a ragged batch cut by a common chunk size. Without it, lengths that
live only on the device are taken at the table capacity (the bucket's design point: every
row split alike), and reading them back would synchronise the step.

One helper serves both callers, the model path (`model/attention.py`) and the attention-only
`Forward` path (`forward.py`): `pool.begin_decode(...)` once per step returns a `DecodeStep`,
whose `run(layer, query, out)` is called per layer whichever way it launches.

The rule (`graph_fallback`, the whole of it): graphs are used when the pool was built with
`cuda_graphs=True` on the CUDA backend and the step fits them: at most the largest bucket (256)
of sequences, tables at most `max_blocks_per_seq` wide (the pool's context cap in blocks), and
the query heads, dtype and softmax scale the graphs were built for. Any other step launches
directly and is counted by reason in `DecodePathStats` (the node exports it as
`pagedkv_cn_decode_steps`). A pool without graphs (the CPU, or switched off) counts nothing.

Binding: one `DecodeGraphs` per pool, built at the first step that can use graphs, for that
step's (heads, dtype, scale). In the model path these are the model's and never change; a
`Forward` client sending other ones falls back (counted).

Capture timing: lazily, each (layer, bucket) graph at its first replay. Which buckets a node
sees depends on its traffic (a node that batches 8 sequences never needs 256); capturing every
bucket of every layer up front would cost layers × 9 captures at start-up (each synchronises
the device) and the static buffers of buckets never used. The price of laziness is paid once
per bucket: the first step of a new size also captures one graph per layer.

Memory (bounded, allocated per bucket at its first use): for bucket b, a query and an output
buffer of b·heads·head_dim elements, a b × max_blocks_per_seq int32 table and b int32 lengths,
and the split-K scratch of its plan's worst case, items·heads·(head_dim + 2) float32, where
items (`decode_policy.graph_items`: the design point's partitions, or the batch plus one more
wave of the split kernel, so that a ragged step can split in any bucket) is bounded by the GPU's
resident blocks, not by the context. Buckets double, so their buffers total under twice the
largest bucket's: for 32 query / 8 KV heads of 128 in fp16 with 512-block tables, about 8.4 MB
of query and output buffers, 1 MB of tables and (on an H200: 660 split-K slots) about 21 MB of
split scratch over the nine buckets — some 31 MB per pool. The graphs hold kernel launches only
(a plan allocates nothing inside a capture).
`DecodePath.static_bytes` gives the real figure (metric `pagedkv_cn_decode_graph_bytes`).

The graphs' static output is overwritten by the next replay (the next layer), so `run` always
copies into `out`, a fresh tensor when none is given: nothing it returns aliases graph memory.

Whole-step graphs (`step_graph.py`, opt-in) capture a pure-decode step's entire forward instead;
inside that capture the decode group is a `PlannedDecodeStep`, which launches the bucket's
`DecodePlan` directly (graphs do not nest), and this per-layer path is not used for the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from compute_node.pool import KvPool

# The longest context the graphs hold when the pool's owner gives none (the attention-only
# node): it sizes each bucket's table, 4 bytes per block per row.
DEFAULT_GRAPH_CONTEXT = 32768


class StaleDecodeStep(RuntimeError):
    """A graphed `DecodeStep` was run after a later step began on the same pool: the graphs'
    static tables hold the later batch, so a replay would attend the wrong sequences."""


class StepShape(NamedTuple):
    """What a step's decode queries look like: the graphs replay exactly one shape."""

    num_heads: int
    dtype: torch.dtype
    scale: float


class GraphLimits(NamedTuple):
    largest_bucket: int        # most sequences one replay holds
    max_blocks_per_seq: int    # widest block table the static buffers hold


def graph_fallback(limits: GraphLimits, bound: StepShape | None, num_seqs: int, table_width: int,
                   shape: StepShape) -> str | None:
    """None when a decode step can replay the graphs, else why not (the fallback's label).

    `bound`: the shape the pool's graphs were built for; None before the first graphed step
    (which then binds them to its own shape)."""
    if num_seqs > limits.largest_bucket:
        return "batch"
    if table_width > limits.max_blocks_per_seq:
        return "table_width"
    if bound is not None:
        if shape.dtype != bound.dtype:
            return "dtype"
        if shape.num_heads != bound.num_heads:
            return "num_heads"
        if shape.scale != bound.scale:
            return "scale"
    return None


@dataclass(slots=True)
class DecodePathStats:
    """Decode steps by path, since the pool was built (only when graphs are enabled)."""

    graph_steps: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)   # reason -> steps

    def counts(self) -> dict[str, int]:
        """`{"graph": n, "fallback_<reason>": n, ...}`: one label per path."""
        fallbacks = dict(self.fallbacks)   # one atomic copy: a metrics scrape runs in another thread
        return {"graph": self.graph_steps, **{f"fallback_{r}": n for r, n in fallbacks.items()}}


class DecodeStep:
    """One step's decode group, bound to the path chosen for it by `DecodePath.begin`."""

    def __init__(self, path: DecodePath, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, generation: int | None, host_seq_lens: np.ndarray | None = None) -> None:
        self._path = path
        self.block_tables, self.seq_lens, self.scale = block_tables, seq_lens, scale
        self.host_seq_lens = host_seq_lens  # the direct launch partitions from these
        self._generation = generation   # None: the direct launch (holds its own tables)

    @property
    def graphed(self) -> bool:
        return self._generation is not None

    def run(self, layer: int, query: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `layer` for the step's sequences, into `out` when given (returned)."""
        if self._generation is None:
            return self._path.pool.decode(layer, query, self.block_tables, self.seq_lens, self.scale, out=out,
                                          host_seq_lens=self.host_seq_lens)
        return self._path.replay(self._generation, layer, query, torch.empty_like(query) if out is None else out)


class PlannedDecodeStep(DecodeStep):
    """The decode group inside a whole-step graph (`compute_node/step_graph.py`): each layer
    launches the bucket's `DecodePlan` over static tables and lengths, with the kernel
    (one-pass or split-K) fixed when the step was captured. No per-layer graph here: CUDA
    graphs do not nest, and the whole step is one capture already. The plan allocates, copies
    and reads back nothing, so every layer's launch is capturable."""

    def __init__(self, path: DecodePath, plan: Any, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, split: bool) -> None:
        super().__init__(path, block_tables, seq_lens, scale, None)
        self._plan, self._split = plan, split

    def run(self, layer: int, query: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(query) if out is None else out
        pool = self._path.pool
        self._plan.launch(query, pool.key_caches[layer], pool.value_caches[layer], self.block_tables,
                          self.seq_lens, self.scale, out, split=self._split)
        return out


class DecodePath:
    """The pool's choice, per step, between the graphs and the direct launch (module doc)."""

    def __init__(self, pool: KvPool, *, cuda_graphs: bool, max_context: int) -> None:
        self.pool = pool
        self.enabled = cuda_graphs and pool.backend == "cuda"
        self.stats = DecodePathStats()
        self.limits = GraphLimits(0, 0)
        if self.enabled:
            from kernels.cuda.graph import DEFAULT_BUCKETS  # numba.cuda only on the CUDA path

            geometry = pool.geometry
            width = min(geometry.num_blocks, -(-max_context // geometry.block_size))
            self.limits = GraphLimits(max(DEFAULT_BUCKETS), width)
        self._graphs: Any = None              # kernels.DecodeGraphs, built by the first graphed step
        self._bound: StepShape | None = None
        self._generation = 0

    def begin(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, shape: StepShape,
              host_seq_lens: np.ndarray | None = None) -> DecodeStep:
        """Choose this step's path; for graphs, load its tables and lengths (once per step).
        `host_seq_lens`: the same lengths on the host (int [num_seqs]), from which the graphs
        partition the step (module doc), and the direct launch too; None leaves the bucket's
        design point (graphs) or every sequence at the tables' capacity (direct)."""
        self._generation += 1
        # the CPU kernels read the lengths themselves: no check of a host copy at every layer
        direct_lens = None if self.pool.backend == "cpu" else host_seq_lens
        if not self.enabled:
            return DecodeStep(self, block_tables, seq_lens, shape.scale, None, direct_lens)
        reason = graph_fallback(self.limits, self._bound, int(block_tables.shape[0]), int(block_tables.shape[1]),
                                shape)
        if reason is not None:
            self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
            return DecodeStep(self, block_tables, seq_lens, shape.scale, None, direct_lens)
        # Inference mode throughout: buffers a bucket creates here are updated in place by
        # later steps, and an inference tensor may only be updated inside inference mode
        # (the model path runs in it, the Forward path does not).
        with torch.inference_mode():
            self._bind(shape).prepare(block_tables, seq_lens, host_seq_lens=host_seq_lens)
        self.stats.graph_steps += 1
        return DecodeStep(self, block_tables, seq_lens, shape.scale, self._generation)

    def replay(self, generation: int, layer: int, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if generation != self._generation:
            raise StaleDecodeStep(f"decode step {generation} run after step {self._generation} began")
        with torch.inference_mode():
            return self._graphs.run(layer, query, out=out)

    def static_bytes(self) -> int:
        """Device bytes of the graphs' static buffers so far (0 before the first graphed step)."""
        return 0 if self._graphs is None else int(self._graphs.static_bytes())

    def _bind(self, shape: StepShape) -> Any:
        if self._graphs is None:
            import kernels

            pool = self.pool
            self._graphs = kernels.DecodeGraphs(
                pool.key_caches, pool.value_caches, shape.num_heads, self.limits.max_blocks_per_seq, shape.scale,
                dtype=shape.dtype,
            )
            self._bound = shape
        return self._graphs
