"""CPU prefill attention of a model step through torch's scaled-dot-product attention, for
float32 caches: per prefill sequence, its context's K/V gathered from the pages, then one
fused attention call (causal; a chunk after a cached prefix sees the whole prefix).

Why not the Numba tile kernel (`attend.prefill_tile`) here: prefill is a matrix product per
(query tile, key tile), and Numba gives no control of vector registers, so the tile kernel runs
at ~20-40 GFLOP/s; torch's CPU flash-attention kernel is register-blocked for the host's
vector width. Measured on this project's 2-core AVX-512 VM (torch 2.13, 9 query / 3 KV heads of
64): a 2,048-token prompt 33 ms vs 143 ms per layer, a 512-token chunk after 1,024 cached tokens
9.4 vs 32.9 ms, 40 tokens after a 256-token shared prefix 0.18 vs 0.66 ms (BENCHMARKS.md). The
gather copies each sequence's context once per layer (a 2,048-token context of 3 KV heads:
1.5 MB per K or V, ~0.3 ms), small next to the attention itself.

One difference from the tiles: SDPA multiplies masked (future) keys' zero probabilities by
their values, so a NaN in a later position's V reaches earlier rows of the same chunk, where the
tiles never read a masked key. Every key a chunk masks is one of its own later tokens, written
by this very step: a NaN there means the model already diverged on that sequence, and nothing
outside the sequence's own rows is touched (the gather stops at its context length).

fp16/bf16 caches keep the Numba kernel (they would need a widened copy of every context, and
a CPU model in float32 is what the engine serves by default). The step's K/V writes and decode
rows stay in the one Numba call per layer (`step.py`); this runs right after it, so every row's
K/V of the step is in the cache before any prefill query reads it (a prompt sharing a prefix
filled in the same step reads those blocks, see `compute_node.model.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Seq:
    rows: slice                 # its query rows in the step
    blocks: torch.Tensor        # int64 [num_blocks]: its table's used blocks
    ctx: int                    # keys it attends to (its length after this step)
    mask: torch.Tensor | None   # float [q_len, ctx], 0 / -inf (bottom-right causal); None: square


class SdpaPrefill:
    """The prefill rows of one model step, planned once (gather indices and masks are the same
    for every layer), run once per layer."""

    def __init__(self, tables: np.ndarray, seq_lens: np.ndarray, starts: np.ndarray, block_size: int,
                 scale: float, only: np.ndarray | None = None) -> None:
        """`tables` int32 `[num_seqs, max_blocks]`, `seq_lens` int32 `[num_seqs]`, `starts` int32
        `[num_seqs + 1]`: each sequence's first query row in the step (validated by the caller,
        `StepAttention`); `only`: bool `[num_seqs]`, the sequences to attend (None: all)."""
        self.scale = float(scale)
        self.seqs: list[_Seq] = []
        for s in range(len(seq_lens)):
            r0, r1 = int(starts[s]), int(starts[s + 1])
            q_len, ctx = r1 - r0, int(seq_lens[s])
            if q_len == 0 or (only is not None and not only[s]):
                continue
            blocks = torch.from_numpy(tables[s, : -(-ctx // block_size)].astype(np.int64))
            mask = None
            if q_len != ctx:   # query j sits at position ctx - q_len + j and sees keys 0 … that
                visible = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
                mask = torch.zeros(q_len, ctx).masked_fill_(~visible, float("-inf"))
            self.seqs.append(_Seq(slice(r0, r1), blocks, ctx, mask))

    def run(self, key_cache: torch.Tensor, value_cache: torch.Tensor, query: torch.Tensor, out: torch.Tensor) -> None:
        """Attend every prefill row of `query` `[rows, num_heads, head_dim]` into the same rows
        of `out`; caches float32 `[num_blocks, num_kv_heads, block_size, head_dim]`."""
        num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
        for seq in self.seqs:
            k = _gather(key_cache, seq.blocks, seq.ctx, num_kv_heads, head_dim)   # [1, kv_heads, ctx, head_dim]
            v = _gather(value_cache, seq.blocks, seq.ctx, num_kv_heads, head_dim)
            q = query[seq.rows].transpose(0, 1).unsqueeze(0)                     # [1, heads, q_len, head_dim]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=seq.mask, is_causal=seq.mask is None,
                                               scale=self.scale, enable_gqa=True)
            out[seq.rows] = o[0].transpose(0, 1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, ctx: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    # [num_blocks, kv_heads, block_size, head_dim] pages -> [1, kv_heads, ctx, head_dim]
    pages = cache.index_select(0, blocks).transpose(0, 1)   # [kv_heads, blocks, block_size, head_dim]
    return pages.reshape(num_kv_heads, -1, head_dim)[:, :ctx].unsqueeze(0)
