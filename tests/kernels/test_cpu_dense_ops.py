"""The fused CPU dense-layer kernels (`kernels.cpu.rms_norm`, `kernels.cpu.rope`) against
float64 references on random inputs: decode- and prefill-sized row counts, odd hidden sizes,
GQA head counts, shuffled positions far into the context; and the input checks (typed errors,
nothing written)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import KernelInputError
from kernels.cpu.rms_norm import rms_norm
from kernels.cpu.rope import rope_qkv

# rows: one token, a decode step, a prefill chunk
ROWS = [1, 7, 300]


def _rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 576, 901])
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_matches_float64(rows: int, hidden: int, with_delta: bool) -> None:
    rng = np.random.default_rng(rows * 1000 + hidden + with_delta)
    x = _rand(rng, rows, hidden, scale=3.0)
    delta = _rand(rng, rows, hidden) if with_delta else None
    weight = _rand(rng, hidden) + 1.0
    eps = 1e-6
    x64 = x.double() + (delta.double() if delta is not None else 0.0)
    ref = weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    expected_sum = x + delta if delta is not None else x.clone()
    out = rms_norm(x, weight, eps, residual_delta=delta)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, expected_sum)   # the residual stream: the same float32 add, in place


def test_rms_norm_writes_into_out_and_takes_numpy() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 32)).astype(np.float32)
    w = np.ones(32, np.float32)
    out = np.full((5, 32), np.nan, np.float32)
    assert rms_norm(x, w, 1e-5, out) is out
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)


def _rope_reference(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, nh: int, nkv: int,
                    hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' rotate_half RoPE in float64."""
    x = qkv.double().view(qkv.shape[0], nh + 2 * nkv, hd)
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()

    def rotate(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    return rotate(x[:, :nh]), rotate(x[:, nh:nh + nkv]), x[:, nh + nkv:]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (14, 2, 64), (8, 1, 128)])
def test_rope_qkv_matches_float64(rows: int, heads: tuple[int, int, int]) -> None:
    nh, nkv, hd = heads
    rng = np.random.default_rng(rows + nh * 10 + hd)
    qkv = _rand(rng, rows, (nh + 2 * nkv) * hd)
    positions = torch.from_numpy(rng.permutation(4096)[:rows].astype(np.int64))   # shuffled, far out
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = positions.float()[:, None] * inv_freq[None, :]   # the float32 angles the model passes
    q = torch.full((rows, nh, hd), float("nan"))
    k = torch.full((rows, nkv, hd), float("nan"))
    v = torch.full((rows, nkv, hd), float("nan"))
    rope_qkv(qkv, freqs.cos(), freqs.sin(), nh, nkv, hd, q, k, v)
    ref_q, ref_k, ref_v = _rope_reference(qkv, positions, inv_freq, nh, nkv, hd)
    # the angles are float32 (as transformers computes them): at position ~4000 that is ~2e-4
    # rad of rounding in the angle itself, the same for both; compare against those angles
    cos64, sin64 = freqs.double().cos(), freqs.double().sin()
    x = qkv.double().view(rows, nh + 2 * nkv, hd)
    half = hd // 2
    rot = torch.cat((x[..., :half] * cos64[:, None] - x[..., half:] * sin64[:, None],
                     x[..., half:] * cos64[:, None] + x[..., :half] * sin64[:, None]), dim=-1)
    torch.testing.assert_close(q.double(), rot[:, :nh], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), rot[:, nh:nh + nkv], rtol=1e-5, atol=1e-5)
    assert torch.equal(v, qkv.view(rows, nh + 2 * nkv, hd)[:, nh + nkv:])
    # and against transformers' formula with exact angles, to the angles' float32 rounding
    torch.testing.assert_close(q.double(), ref_q, rtol=0, atol=5e-3 * float(x.abs().max()))
    torch.testing.assert_close(k.double(), ref_k, rtol=0, atol=5e-3 * float(x.abs().max()))
    assert torch.equal(v.double(), ref_v)


@pytest.mark.parametrize("call", [
    lambda: rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-5),
    lambda: rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5),
    lambda: rms_norm(torch.ones(8, 2).t(), torch.ones(8), 1e-5),
    lambda: rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5, residual_delta=torch.ones(3, 8)),
    lambda: rope_qkv(torch.ones(2, 5 * 4), torch.ones(2, 2), torch.ones(2, 2), 3, 1, 4,
                     torch.empty(2, 2, 4), torch.empty(2, 1, 4), torch.empty(2, 1, 4)),
    lambda: rope_qkv(torch.ones(2, 5 * 4), torch.ones(2, 2), torch.ones(2, 2), 2, 1, 4,
                     torch.empty(2, 2, 4), torch.empty(2, 1, 4), torch.empty(2, 1, 4)),
    lambda: rope_qkv(torch.ones(2, 5 * 3), torch.ones(2, 1), torch.ones(2, 1), 3, 1, 3,
                     torch.empty(2, 3, 3), torch.empty(2, 1, 3), torch.empty(2, 1, 3)),
], ids=["float64", "weight size", "strided", "delta rows", "q heads",
        "q/k/v width", "odd head_dim"])
def test_bad_input_is_a_typed_error(call) -> None:
    with pytest.raises(KernelInputError):
        call()


def test_bad_delta_leaves_the_residual_untouched() -> None:
    x = torch.arange(16, dtype=torch.float32).view(2, 8)
    before = x.clone()
    with pytest.raises(KernelInputError):
        rms_norm(x, torch.ones(8), 1e-5, residual_delta=torch.ones(2, 8, dtype=torch.float64))
    assert torch.equal(x, before)
