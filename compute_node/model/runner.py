"""`ModelRunner`: the node-side API that runs a decoder over the node's KV pool, one step at a
time, for whatever mix of prefill and decode sequences the scheduler sends.

The scheduler owns every block decision (which blocks a sequence has, prefix-cache hits,
copy-on-write, defragmentation moves); the runner only executes: it derives slots from the
given block tables and positions, writes K/V there, attends over the pages and samples. One
step, one call:

    runner.copy_blocks(step.copy_pairs)       # CoW copies / defrag moves, before the writes
    outputs = runner.execute(step.sequences)  # list aligned with the batch; None = nothing sampled
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compute_node.decode_path import StepShape
from compute_node.host_pool import HostKvPool, host_blocks_for_budget
from compute_node.model.attention import PhaseTimer
from compute_node.model.batch import PromptLogprobs, SeqOutput, SeqWork, StepInputs, StepResult, prepare_step
from compute_node.model.config import ModelConfig, resolve_dtype
from compute_node.model.errors import InvalidBatch, ModelLoadError
from compute_node.model.model import DecoderModel
from compute_node.model.sampling import Sampler, score_rows
from compute_node.model.weights import Checkpoint
from compute_node.pool import KvPool, PoolGeometry, blocks_for_budget, resolve_device
from compute_node.step_graph import StepGraphs

# Rows of prompt logits computed at once (prompt log-probabilities): 256 x a 152k vocabulary
# is 155 MB of float32, bounded whatever the prompt's length.
PROMPT_LOGITS_ROWS = 256


@dataclass(slots=True)
class StepTimings:
    """Where one `execute` spent its time (seconds), when `ModelRunner.profile` is on."""

    prepare_s: float = 0.0     # checking the batch, building index tensors (host)
    dense_s: float = 0.0       # embedding, norms, matmuls, RoPE, LM head (torch ops and the layer loop)
    attention_s: float = 0.0   # K/V writes and paged attention kernels
    sample_s: float = 0.0
    total_s: float = 0.0

    @property
    def host_s(self) -> float:
        """Everything else: building the outputs, bookkeeping between the phases."""
        return self.total_s - self.prepare_s - self.dense_s - self.attention_s - self.sample_s


@dataclass(slots=True)
class DebugForward:
    """Every new token's final-normed hidden state and logits, in batch order (tests only)."""

    hidden_states: torch.Tensor   # [num_tokens, hidden]
    logits: torch.Tensor          # float32 [num_tokens, vocab]


class ModelRunner:
    """Loads a Hugging Face decoder directory and runs batches over its own KV pool.

    Exactly one of `num_blocks` and `kv_memory_bytes` sizes the pool. `dtype` overrides the
    checkpoint's (`config.json` torch_dtype); the KV pool uses the same dtype. `max_model_len`
    caps positions below the model's `max_position_embeddings` (never above it).
    `cuda_graphs`: on a GPU, decode attention replays CUDA graphs (one per layer and batch-size
    bucket, sized for `max_model_len`) where a step fits them (`compute_node/decode_path.py`);
    ignored on the CPU. `step_graphs` (opt-in until measured on a GPU): a pure-decode step that
    fits replays one CUDA graph of the whole forward per batch-size bucket instead
    (`compute_node/step_graph.py`); other steps run as without it. `prepack_linear`: on the
    CPU (float32 / bfloat16), the matmul weights are packed once for oneDNN
    (`compute_node.model.linear`: ~2x faster decode steps than plain `F.linear`); False keeps
    plain weights and `F.linear` (what transformers runs).

    One step at a time: the runner is not thread-safe (the scheduler is the one sequencer of a
    pool, so the servicer calls it from one thread or under a lock).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        dtype: str | torch.dtype | None = None,
        device: str = "auto",
        max_model_len: int | None = None,
        cuda_graphs: bool = True,
        prepack_linear: bool = True,
        step_graphs: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        cfg = self.model_config
        self.dtype = resolve_dtype(dtype, cfg.dtype)
        try:
            self.device = resolve_device(device)
        except (ValueError, RuntimeError) as exc:
            reason = str(exc)
            raise ModelLoadError(reason if repr(device) in reason else f"device {device!r}: {reason}") from None
        if block_size < 1:
            raise ModelLoadError(f"block_size must be >= 1, got {block_size}")
        if (num_blocks is None) == (kv_memory_bytes is None):
            raise ModelLoadError("give exactly one of num_blocks and kv_memory_bytes")
        if num_blocks is None:
            num_blocks = blocks_for_budget(
                int(kv_memory_bytes or 0), num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, dtype=self.dtype, block_size=block_size,
            )
        if num_blocks < 1:
            raise ModelLoadError(f"the KV pool needs at least one block, got {num_blocks}")
        if max_model_len is not None and not 1 <= max_model_len <= cfg.max_position_embeddings:
            raise ModelLoadError(f"max_model_len must be in [1, {cfg.max_position_embeddings}], got {max_model_len}")
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        with Checkpoint(model_dir) as checkpoint:
            self.model = DecoderModel.load(checkpoint, cfg, self.dtype, self.device, prepack_linear)
        geometry = PoolGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, block_size, num_blocks)
        self.pool = KvPool(geometry, self.device, cuda_graphs=cuda_graphs, max_context=self.max_model_len)
        self.host_pool: HostKvPool | None = None   # the host tier, when attached (attach_host_tier)
        self.disk_store: Any = None   # the disk tier under it (compute_node.disk_tier.DiskKvStore), if any
        self.sampler = Sampler()
        # CPU: a step's attention through one kernel call per layer (`KvPool.begin_cpu_step`);
        # False runs the generic per-kernel calls instead (write, decode, prefill: what the
        # attention-only Forward path runs), kept for side-by-side benchmarks.
        self.fused_cpu_attention = True
        self.profile = False
        self.last_timings: StepTimings | None = None
        self.step_graphs = step_graphs
        self._step_graphs: StepGraphs | None = None   # built at the first step that can use them

    @property
    def geometry(self) -> PoolGeometry:
        return self.pool.geometry

    def attach_host_tier(self, num_blocks: int | None = None, memory_bytes: int | None = None) -> int:
        """Give the node a host tier of `num_blocks` (or as many as fit in `memory_bytes`);
        returns its number of blocks (0: none, the budget holds no block)."""
        if num_blocks is None:
            num_blocks = host_blocks_for_budget(int(memory_bytes or 0), self.geometry)
        if num_blocks < 0:
            raise ModelLoadError(f"host tier blocks must be >= 0, got {num_blocks}")
        self.host_pool = HostKvPool(self.geometry, num_blocks, self.device) if num_blocks else None
        return num_blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer, in order (CoW copies, defrag moves)."""
        num_blocks = self.geometry.num_blocks
        for pair in pairs:
            if len(pair) != 2 or not all(isinstance(b, (int, np.integer)) and 0 <= b < num_blocks for b in pair):
                raise InvalidBatch(f"copy pair {pair!r} must be two block ids in [0, {num_blocks})")
        self.pool.copy_blocks([(int(src), int(dst)) for src, dst in pairs])

    def execute(self, batch: Sequence[SeqWork]) -> list[SeqOutput | None]:
        """Run one step: compute K/V and hidden states of every sequence's new tokens and sample
        one token for each sequence that asks. Returns one entry per `batch` item, in order:
        a `SeqOutput`, or None where `sample` is None. Raises `InvalidBatch` (pool untouched)."""
        return self.run_step(batch).outputs

    @torch.inference_mode()
    def run_step(self, batch: Sequence[SeqWork]) -> StepResult:
        """`execute`, plus the prompt log-probabilities of the items that ask
        (`SeqWork.prompt_logprobs`), scored from this same forward pass's hidden rows."""
        outputs: list[SeqOutput | None] = [None] * len(batch)
        if not batch:
            return StepResult(outputs)
        timings = StepTimings() if self.profile else None
        started = time.perf_counter()
        graphs = self._graphed_step(batch)
        inputs = self._prepare(batch, graphs)
        prepared = time.perf_counter()
        timer = PhaseTimer() if timings is not None else None
        all_logits = None
        if graphs is not None and graphs.load(inputs):
            hidden, all_logits = graphs.replay()   # the whole forward, logits of every row
        else:
            if graphs is not None:   # it did not fit: bind the per-layer decode path after all
                self._bind_decode(inputs)
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.pool, inputs.meta, timer)
        sampled_at = forwarded = self._sync_time()
        if inputs.sample_seqs:
            if all_logits is not None:
                logits = all_logits[inputs.sample_rows]
            else:
                logits = self.model.logits(hidden[inputs.sample_rows])   # float32 [num_sampled, vocab]
            forwarded = self._sync_time()
            seqs = [batch[i] for i in inputs.sample_seqs]
            params = [s.sample for s in seqs if s.sample is not None]
            sampled = self.sampler.sample(logits, params, [s.num_output_tokens for s in seqs])
            sampled_at = time.perf_counter()
            for i, seq, token in zip(inputs.sample_seqs, seqs, sampled):
                outputs[i] = SeqOutput(seq.seq_id, token.token_id, token.logprob, token.top_logprobs)
        scored = self._prompt_logprobs(batch, inputs, hidden)
        if timings is not None and timer is not None:
            timings.prepare_s = prepared - started
            timings.attention_s = timer.attention_s
            timings.dense_s = forwarded - prepared - timer.attention_s
            timings.sample_s = time.perf_counter() - forwarded if scored else sampled_at - forwarded
            timings.total_s = time.perf_counter() - started
            self.last_timings = timings
        return StepResult(outputs, scored)

    def _prompt_logprobs(self, batch: Sequence[SeqWork], inputs: StepInputs,
                         hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Each asking item's scored rows, in batch order: the LM head runs only over those rows
        (in slices of `PROMPT_LOGITS_ROWS`, so a long prompt never holds `[tokens, vocab]` logits
        at once); a step where no item asks computes nothing more than before."""
        asked = [(j, w, w.prompt_logprobs) for j, w in enumerate(batch) if w.prompt_logprobs is not None]
        if not asked:
            return []
        group_of = {b: g for g, b in enumerate(inputs.row_order)}   # batch index -> row group
        out: list[PromptLogprobs] = []
        for j, w, req in asked:
            first_row = int(inputs.row_starts[group_of[j]]) + req.first_position - w.num_computed_tokens
            targets = torch.tensor(req.target_token_ids, dtype=torch.int64, device=hidden.device)
            scored = PromptLogprobs(w.seq_id, [], [], [])
            for lo in range(0, len(req.target_token_ids), PROMPT_LOGITS_ROWS):
                hi = min(lo + PROMPT_LOGITS_ROWS, len(req.target_token_ids))
                logits = self.model.logits(hidden[first_row + lo : first_row + hi])
                score_rows(logits, targets[lo:hi], req.num_top, scored)
            out.append(scored)
        return out

    @torch.inference_mode()
    def debug_forward(self, batch: Sequence[SeqWork]) -> DebugForward:
        """Like `execute` (K/V written the same way), but returns every new token's hidden state
        and logits instead of sampling. For tests and diagnostics, never the serving path."""
        inputs = self._prepare(batch)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.pool, inputs.meta)
        # Rows are decode-first; put them back in batch order.
        rows = [torch.arange(int(inputs.row_starts[j]), int(inputs.row_starts[j + 1]))
                for j in np.argsort(inputs.row_order, kind="stable")]
        hidden = hidden[torch.cat(rows).to(hidden.device)]
        return DebugForward(self.model.final_hidden(hidden), self.model.logits(hidden))

    def _graphed_step(self, batch: Sequence[SeqWork]) -> StepGraphs | None:
        """The whole-step graphs, when enabled and this is a pure-decode step on the CUDA
        backend (they are built, for the pool the runner holds now, at the first such step)."""
        if not self.step_graphs or self.pool.backend != "cuda" or any(len(w.token_ids) != 1 for w in batch):
            return None
        if self._step_graphs is None or self._step_graphs.pool is not self.pool:
            self._step_graphs = StepGraphs(self.model, self.pool, max_context=self.max_model_len)
        return self._step_graphs

    def _prepare(self, batch: Sequence[SeqWork], graphs: StepGraphs | None = None) -> StepInputs:
        """The step's checked inputs, with its attention bound to the pool once (on the CPU the
        whole step's `StepAttention`; on a GPU the decode group, graph buffers loaded here), not
        per layer. With `graphs` (a whole-step graph may run it) the decode group is left
        unbound: `run_step` binds it only if the step does not fit them."""
        cfg = self.model_config
        inputs = prepare_step(
            batch, self.geometry, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
            head_dim=cfg.head_dim, device=self.device,
        )
        meta = inputs.meta
        if self.pool.backend == "cpu" and self.fused_cpu_attention:
            meta.cpu_step = self.pool.begin_cpu_step(
                num_heads=cfg.num_heads, slot_mapping=meta.slot_mapping, num_decode_tokens=meta.num_decode_tokens,
                decode_block_tables=meta.decode_block_tables, decode_seq_lens=meta.decode_seq_lens,
                prefill_block_tables=meta.prefill_block_tables, prefill_seq_lens=meta.prefill_seq_lens,
                prefill_query_start_loc=meta.prefill_query_start_loc, scale=meta.scale,
            )
        elif graphs is None:
            self._bind_decode(inputs)
        return inputs

    def _bind_decode(self, inputs: StepInputs) -> None:
        meta = inputs.meta
        if meta.decode_block_tables is not None and meta.decode_seq_lens is not None:
            shape = StepShape(self.model_config.num_heads, self.model.dtype, meta.scale)
            meta.decode = self.pool.begin_decode(
                meta.decode_block_tables, meta.decode_seq_lens, shape, host_seq_lens=inputs.decode_seq_lens_host
            )

    def _sync_time(self) -> float:
        if self.profile and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()
