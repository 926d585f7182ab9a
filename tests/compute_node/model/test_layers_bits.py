"""The dense building blocks give transformers' bits, not just close values: the runner is
compared token for token with transformers, and `layers.py` trims torch calls (RoPE by a roll
and a signed sine, RMSNorm without no-op casts) on the claim that the arithmetic is unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from compute_node.model.layers import apply_rope, rms_norm, rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    num_tokens, head_dim = 37, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.randint(0, 4000, (num_tokens,), generator=g)
    qkv = (torch.randn(num_tokens, 9 + 3 + 3, head_dim, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split((9, 3, 3), dim=1)   # strided views, as the model passes them
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    ours_q, ours_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    # transformers' layout: [batch, heads, tokens, head_dim]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          emb.cos().to(dtype)[None], emb.sin().to(dtype)[None])
    assert torch.equal(ours_q, want_q[0].transpose(0, 1))
    assert torch.equal(ours_k, want_k[0].transpose(0, 1))
    assert ours_q.is_contiguous() and ours_k.is_contiguous()   # the CPU step kernel stores rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(23, 576, generator=g) * 2).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    norm = LlamaRMSNorm(576, eps=1e-6).to(dtype)
    norm.weight.data = weight
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, 1e-6), norm(x))
