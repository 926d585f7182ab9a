"""The dense building blocks, as plain functions over flat token batches `[num_tokens, ...]`.

Each one computes what the transformers implementation of Llama / Qwen2 / Qwen3 computes, in
the same order and precision, because the runner is tested token for token against it: RMSNorm
normalises in float32 and casts back before the weight multiply; RoPE builds cos/sin in float32
from `position * inv_freq` and rotates in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim, normalised in float32."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[num_tokens, head_dim // 2]` of each token's rotation angles.

    Only one half is kept: transformers' cos/sin are this half repeated twice, so rotating with
    the half (see `apply_rope`) gives the same numbers with half the trig work.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]   # [num_tokens, head_dim // 2]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[num_tokens, num_heads, head_dim]` by its token's angles (the half-split
    "rotate_half" convention of Llama/Qwen checkpoints): `x * cos + rotate_half(x) * sin`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]   # [num_tokens, 1, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`, with gate and up fused in one matmul."""
    gate, up = F.linear(x, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight, down_bias)
