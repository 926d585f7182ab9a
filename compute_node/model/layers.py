"""The dense building blocks, as plain functions over flat token batches `[num_tokens, ...]`.

Each one computes what the transformers implementation of Llama / Qwen2 / Qwen3 computes, in
the same order and precision, because the runner is tested token for token against it (the
matmuls too, with plain weights; packed for oneDNN they sum in another order, which moves the
float rounding and nothing else: `compute_node.model.linear`): RMSNorm
normalises in float32 and casts back before the weight multiply; RoPE builds cos/sin in float32
from `position * inv_freq` and rotates in the activation dtype. Each torch call costs a few µs
of dispatch whatever its size (a decode step makes ~1,500 of them on a 30-layer model), so the
functions use as few calls as give the same bits.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim, normalised in float32 (the casts are skipped
    when `x` already is: each would be one more torch call per norm, 60 norms a step)."""
    x32 = x if x.dtype == torch.float32 else x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if normed.dtype == x.dtype else normed.to(x.dtype))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[num_tokens, head_dim // 2]` of each token's rotation angles
    (`position * inv_freq`, as transformers computes them), once per step for every layer."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]   # [num_tokens, head_dim // 2]
    return freqs.cos(), freqs.sin()


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin `[num_tokens, 1, head_dim]` of each token's rotation angles, shaped
    to broadcast over heads, computed once per step for every layer.

    cos is transformers' (the half-width angles' cosines twice); the sine's first half is
    negated, which moves `rotate_half`'s negation into the sine (see `apply_rope`).
    """
    cos, sin = rope_angles(positions, inv_freq)
    cos, sin = cos.to(dtype), sin.to(dtype)
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[num_tokens, num_heads, head_dim]` by its token's angles (the half-split
    "rotate_half" convention of Llama/Qwen checkpoints): `x * cos + rotate_half(x) * sin`.

    `rotate_half(x)` is `[-x2, x1]`; rolling x by half a head gives `[x2, x1]`, and the signed
    sine supplies the minus: `(-x2) * s` and `x2 * (-s)` are the same float (negation is exact),
    so this is transformers' arithmetic bit for bit, in 4 torch calls instead of 11.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
