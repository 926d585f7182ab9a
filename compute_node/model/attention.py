"""Paged attention of one step: K/V written into the pool, then the decode and prefill kernels.

The runner orders a step's tokens decode sequences first (one token each), then prefill
sequences (several tokens each), so the two groups are two contiguous row ranges of every
`[num_tokens, ...]` tensor: each kernel reads a view of the queries and writes a view of one
output tensor, with no gather or scatter per layer. The decode group is launched through the
`DecodeStep` the runner began once for the step (`KvPool.begin_decode`): CUDA graph replays on
a GPU when they fit, the direct kernel launch otherwise.

On the CPU the runner binds a `StepAttention` instead (`KvPool.begin_cpu_step`): the step's
tables, lengths and slots checked and converted once, then one kernel call per layer for the
K/V write and both groups' attention (`kernels/cpu/step.py`: per-call overhead, not math, was
most of the CPU attention time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compute_node.decode_path import DecodeStep
from compute_node.pool import KvPool

if TYPE_CHECKING:
    from kernels.cpu.step import StepAttention


class UnboundDecode(RuntimeError):
    """A step with decode rows reached attention without its `DecodeStep` (the runner binds
    it after `prepare_step`); a bug, never a bad request."""


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors shared by every layer of one step (all on the pool's device)."""

    slot_mapping: torch.Tensor                 # int64 [num_tokens]
    num_decode_tokens: int                     # rows [0, num_decode_tokens) are decode sequences
    decode_block_tables: torch.Tensor | None   # int32 [num_decode_seqs, max_blocks]
    decode_seq_lens: torch.Tensor | None       # int32 [num_decode_seqs]
    prefill_block_tables: torch.Tensor | None  # int32 [num_prefill_seqs, max_blocks]
    prefill_seq_lens: torch.Tensor | None      # int32 [num_prefill_seqs]
    prefill_query_start_loc: torch.Tensor | None  # int32 [num_prefill_seqs + 1], from the group's first row
    scale: float
    prefill_max_query_len: int | None = None   # longest prefill chunk (host value: sizes the grid)
    decode: DecodeStep | None = None           # the decode group's launch, bound by the runner
                                               # (KvPool.begin_decode) once per step
    cpu_step: StepAttention | None = None      # CPU: the whole step's attention, bound by the
                                               # runner (KvPool.begin_cpu_step) once per step


@dataclass(slots=True)
class PhaseTimer:
    """Seconds spent in the attention kernels (K/V writes included) over a step, when profiling.
    On a GPU each phase synchronises, which is why it is off unless asked for."""

    attention_s: float = 0.0

    def start(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    def stop(self, device: torch.device, started: float) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self.attention_s += time.perf_counter() - started


def paged_attention(
    pool: KvPool,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    timer: PhaseTimer | None = None,
) -> torch.Tensor:
    """Store this step's K/V `[num_tokens, num_kv_heads, head_dim]` in `layer`'s pages, then
    attend every query `[num_tokens, num_heads, head_dim]` to its sequence's paged context
    (the cached prefix plus the tokens of this step, causally). Returns `[num_tokens, num_heads,
    head_dim]` in the query's dtype."""
    started = timer.start(pool.device) if timer is not None else 0.0
    if meta.cpu_step is not None:
        out = meta.cpu_step.run(layer, query, key, value)
        if timer is not None:
            timer.stop(pool.device, started)
        return out
    pool.write(layer, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    split = meta.num_decode_tokens
    if split:
        if meta.decode is None:
            raise UnboundDecode(f"{split} decode rows but no DecodeStep in the step's metadata")
        # Into the real output rows: a graph's static output is overwritten by the next layer.
        meta.decode.run(layer, query[:split], out=out[:split])
    if (
        meta.prefill_block_tables is not None
        and meta.prefill_seq_lens is not None
        and meta.prefill_query_start_loc is not None
    ):
        pool.prefill(
            layer, query[split:], meta.prefill_block_tables, meta.prefill_seq_lens,
            meta.prefill_query_start_loc, meta.scale, out=out[split:],
            max_query_len=meta.prefill_max_query_len,
        )
    if timer is not None:
        timer.stop(pool.device, started)
    return out
