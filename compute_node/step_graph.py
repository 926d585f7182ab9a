"""Whole decode steps replayed from CUDA graphs: one graph per (batch-size bucket, kernel).

Why: a decode step on a GPU is ~10 torch calls per layer plus the attention and K/V-write
launches, each paying Python dispatch (µs to tens of µs) on top of kernels that, at small and
moderate batch, take about as long. Graphing decode attention alone (`decode_path.py`, one
graph per layer) leaves the dense layers launched one by one. Here the whole forward of a
pure-decode step — embedding, every layer's norms, matmuls, RoPE, K/V write and attention, the
final norm and the LM head's float32 logits (the sampler's device input) — is one capture per
bucket, and a step costs a handful of small copies into static buffers and one replay.

Static buffers, sized once for the largest bucket and shared by every bucket's graph (each
graph reads the leading rows `[:bucket]`): token ids, positions, slots, block tables
(`max_context` wide) and lengths in; the last hidden states and the logits out. Rows past the
step's batch are padding: token 0 at position 0, slot -1 (the write kernel skips it), length
0 (attention yields zeros), so a padded row writes nothing and is never returned.

Inside the capture nothing reads the device from the host, allocates outside torch's graph
pool, or depends on host values: the attention is the bucket's `DecodePlan` (its grid fixed
at the bucket's worst case), launched per layer through `PlannedDecodeStep`; the write kernel's
grid is the bucket size; every shape is the bucket's. What changes per step is decided before
the replay, on the host: the bucket, and the plan's split-K work list from the step's host
lengths (`DecodePlan.schedule`), which also chooses between the bucket's two graphs (one-pass
and split-K), as `kernels.DecodeGraphs` does per layer.

Graphs of all buckets draw from one memory pool (they never replay at once); their outputs are
copied into the static output buffers, which live outside the pool, so a replay of another
bucket cannot overwrite a result before it is read — but the next replay does: `replay`'s
returned views are valid until the next step. Capture is lazy (a bucket's first step; `capture`
captures up front, largest bucket first, so smaller graphs reuse the pool's memory, the order
nano-vllm's runner uses). Under Numba's simulator a "graph" runs its launch again at each
replay (`kernels.cuda.graph.capture_graph`), so the whole-step logic — buffers, padding,
scheduling, per-bucket plans — is exercised without a GPU; only capture itself is not.

Opt-in (`ModelRunner(step_graphs=True)`, node setting `step_graphs`) until a GPU run of
bench/gpu_check.sh (phase `step_graph`) has measured it against the per-layer path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from compute_node.decode_path import PlannedDecodeStep
from compute_node.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from compute_node.model.batch import StepInputs
    from compute_node.model.model import DecoderModel
    from compute_node.pool import KvPool


@dataclass(slots=True)
class StepGraphStats:
    """Pure-decode steps by path since the graphs were built: replayed, or run eagerly and why."""

    graph_steps: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)   # reason -> steps

    def counts(self) -> dict[str, int]:
        fallbacks = dict(self.fallbacks)
        return {"graph": self.graph_steps, **{f"fallback_{r}": n for r, n in fallbacks.items()}}


@dataclass(slots=True, frozen=True)
class LoadedStep:
    """Which graph the next replay runs: `num_seqs` real rows of bucket `bucket`."""

    num_seqs: int
    bucket: int
    split: bool


class StepGraphs:
    """Per-bucket CUDA graphs of a model's whole decode step over one pool (module doc).

    `max_context`: the longest context a graphed step holds (sizes the static tables, 4 bytes
    per block per row); `buckets`: the batch sizes graphed (a step of n sequences replays the
    smallest bucket >= n). `decode_parts` forces every bucket's attention to that many split-K
    partitions per sequence (tests and benchmarks: the policy splits only long contexts)."""

    def __init__(self, model: DecoderModel, pool: KvPool, *, max_context: int,
                 buckets: Sequence[int] | None = None, decode_parts: int | None = None) -> None:
        from kernels.cuda.graph import DEFAULT_BUCKETS  # numba.cuda only on the CUDA path

        if pool.backend != "cuda":
            raise ValueError(f"whole-step graphs need the cuda backend, this pool runs {pool.backend!r}")
        cfg = model.config
        self.model, self.pool = model, pool
        self.buckets = sorted({int(b) for b in (buckets or DEFAULT_BUCKETS)})
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive, got {buckets}")
        geometry = pool.geometry
        self.max_blocks = min(geometry.num_blocks, -(-max_context // geometry.block_size))
        self.scale = cfg.head_dim ** -0.5
        self.decode_parts = decode_parts
        rows, dev = self.buckets[-1], pool.device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=dev)
        self.lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros((rows, cfg.hidden_size), dtype=model.dtype, device=dev)
        self.logits = torch.zeros((rows, cfg.vocab_size), dtype=torch.float32, device=dev)
        self.stats = StepGraphStats()
        self._plans: dict[int, Any] = {}                 # bucket -> kernels.cuda.plan.DecodePlan
        self._graphs: dict[tuple[int, bool], Any] = {}   # (bucket, split-K?) -> graph
        self._graph_pool: Any = None
        self._loaded: LoadedStep | None = None

    # -- per step -------------------------------------------------------------------------

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fallback(self, inputs: StepInputs) -> str | None:
        """None when this pure-decode step can replay a graph, else why not (counted)."""
        meta = inputs.meta
        tables = meta.decode_block_tables
        if tables is None or self.bucket_for(meta.num_decode_tokens) is None:
            return "batch"
        if int(tables.shape[1]) > self.max_blocks:
            return "table_width"
        if meta.scale != self.scale:
            return "scale"
        return None

    def load(self, inputs: StepInputs) -> bool:
        """Copy a pure-decode step's inputs into the static buffers and schedule its bucket's
        attention; False (nothing loaded, counted by reason) when the step does not fit. Host
        work and stream-ordered copies only: no synchronisation."""
        reason = self.fallback(inputs)
        if reason is not None:
            self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
            self._loaded = None
            return False
        meta = inputs.meta
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        if tables is None or lens is None:   # fallback() checked the tables; lens come with them
            raise RuntimeError("a decode step without lengths")
        n = meta.num_decode_tokens
        bucket = self.bucket_for(n) or n
        width = int(tables.shape[1])
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.tables[:n, :width].copy_(tables, non_blocking=True)
        self.lens[:n].copy_(lens, non_blocking=True)
        if bucket > n:   # padding rows: write nothing, attend to nothing
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].fill_(-1)
            self.lens[n:bucket].zero_()
        padded = None
        if inputs.decode_seq_lens_host is not None:
            padded = np.zeros(bucket, np.int64)
            padded[:n] = inputs.decode_seq_lens_host
        split = self._plan(bucket).schedule(padded)
        self._loaded = LoadedStep(n, bucket, bool(split))
        self.stats.graph_steps += 1
        return True

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the loaded step: (last hidden states `[num_seqs, hidden]`, float32 logits
        `[num_seqs, vocab]`), views of the static outputs valid until the next replay."""
        step = self._loaded
        if step is None:
            raise RuntimeError("replay() without a loaded step (load() returned False or was not called)")
        self._loaded = None   # one replay per load: the work list belongs to this step
        self._graph(step.bucket, step.split).replay()
        return self.hidden[:step.num_seqs], self.logits[:step.num_seqs]

    # -- graphs -----------------------------------------------------------------------------

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Capture every graph of `buckets` (default: all) now, largest first; padded rows
        only (slot -1, length 0), so the warm-up run writes nothing into the pool."""
        for bucket in sorted(buckets or self.buckets, reverse=True):
            self.input_ids[:bucket].zero_()
            self.positions[:bucket].zero_()
            self.slots[:bucket].fill_(-1)
            self.lens[:bucket].zero_()
            plan = self._plan(bucket)
            for split in (False, True) if plan.max_items else (False,):
                self._graph(bucket, split)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def static_bytes(self) -> int:
        """Device bytes of the static buffers and the plans' split-K scratch (the graphs'
        intermediate tensors live in their shared pool, not counted here)."""
        tensors = [self.input_ids, self.positions, self.slots, self.tables, self.lens, self.hidden, self.logits]
        for plan in self._plans.values():
            if plan.scratch is not None:
                tensors += [plan.scratch, plan.work]
        return sum(int(t.numel()) * t.element_size() for t in tensors)

    def _plan(self, bucket: int) -> Any:
        plan = self._plans.get(bucket)
        if plan is None:
            from kernels.cuda._runtime import kind_of
            from kernels.cuda.plan import DecodePlan

            cfg, kc = self.model.config, self.pool.key_caches[0]
            q_kind = kind_of(torch.empty(0, dtype=self.model.dtype))
            plan = self._plans[bucket] = DecodePlan(kc, cfg.num_heads, bucket, self.max_blocks,
                                                    q_kind=q_kind, out_kind=q_kind, num_parts=self.decode_parts)
        return plan

    def _graph(self, bucket: int, split: bool) -> Any:
        graph = self._graphs.get((bucket, split))
        if graph is None:
            from kernels.cuda.graph import capture_graph, new_graph_pool

            if self._graph_pool is None:
                self._graph_pool = new_graph_pool()
            launch = self._forward(bucket, split)
            graph = self._graphs[(bucket, split)] = capture_graph(launch, self._graph_pool)
        return graph

    def _forward(self, bucket: int, split: bool) -> Any:
        """The captured work of one bucket: the model's forward over the static rows, its
        outputs copied into the static output buffers."""
        model, pool, plan = self.model, self.pool, self._plan(bucket)
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        slots, tables, lens = self.slots[:bucket], self.tables[:bucket], self.lens[:bucket]
        hidden_out, logits_out = self.hidden[:bucket], self.logits[:bucket]

        def launch() -> None:
            meta = AttentionMetadata(slots, bucket, tables, lens, None, None, None, self.scale)
            meta.decode = PlannedDecodeStep(pool.decode_path, plan, tables, lens, self.scale, split)
            hidden = model.forward(ids, positions, pool, meta)
            hidden_out.copy_(hidden)
            logits_out.copy_(model.logits(hidden))

        return launch
