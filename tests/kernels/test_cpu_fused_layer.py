"""The fused CPU layer kernels (`kernels.cpu.silu`, `kernels.cpu.fused_layer`) against float64
references on random inputs (ragged row counts and widths, biases or none, the parallel SiLU
branch, two row blocks of the GEMM), against the separate kernels they chain (the same floats),
and their input checks (typed errors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import KernelInputError
from kernels.cpu import gemm
from kernels.cpu.fused_layer import SILU_PARALLEL_ROWS, FusedLayers, LayerWeights
from kernels.cpu.rms_norm import rms_norm
from kernels.cpu.rope import rope_qkv
from kernels.cpu.silu import silu_mul

EPS = 1e-6


def _rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def _silu64(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 7), (13, 200), (70, 33)])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_silu_mul_matches_float64(rows: int, inter: int, scale: float) -> None:
    rng = np.random.default_rng(rows * 100 + inter)
    gate_up = _rand(rng, rows, 2 * inter, scale=scale)
    gate_up[0, : min(inter, 8)] = torch.tensor([0.0, -0.0, 87.5, -87.5, 88.5, -88.5, 500.0, -500.0])[: min(inter, 8)]
    g, u = gate_up.double()[:, :inter], gate_up.double()[:, inter:]
    ref = _silu64(g) * u
    out = silu_mul(gate_up)
    assert out.shape == (rows, inter) and torch.isfinite(out).all()
    # a few float32 ulps of the result (torch's own silu is as far from float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-30)


def test_silu_mul_checks_its_inputs() -> None:
    with pytest.raises(KernelInputError, match="even width"):
        silu_mul(torch.zeros(2, 5))
    with pytest.raises(KernelInputError, match="shape"):
        silu_mul(torch.zeros(2, 6), torch.zeros(2, 4))
    with pytest.raises(KernelInputError, match="float32"):
        silu_mul(torch.zeros(2, 6, dtype=torch.float64))


class Layer:
    """A random layer's weights (float32) and the shapes they chain through."""

    def __init__(self, rng: np.random.Generator, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 inter: int, biases: bool) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.inter = num_heads, num_kv_heads, head_dim, inter
        qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv = _rand(rng, qkv_size, hidden, scale=hidden**-0.5)
        self.o = _rand(rng, hidden, num_heads * head_dim, scale=(num_heads * head_dim) ** -0.5)
        self.gate_up = _rand(rng, 2 * inter, hidden, scale=hidden**-0.5)
        self.down = _rand(rng, hidden, inter, scale=inter**-0.5)
        self.input_norm = _rand(rng, hidden, scale=0.2) + 1.0
        self.post_norm = _rand(rng, hidden, scale=0.2) + 1.0
        self.qkv_bias = _rand(rng, qkv_size) if biases else None
        self.o_bias = _rand(rng, hidden) if biases else None
        self.gate_up_bias = _rand(rng, 2 * inter) if biases else None
        self.down_bias = _rand(rng, hidden) if biases else None
        self.weights = LayerWeights.of(
            self.input_norm, gemm.pack(self.qkv), self.qkv_bias, gemm.pack(self.o), self.o_bias, self.post_norm,
            gemm.pack(self.gate_up), self.gate_up_bias, gemm.pack(self.down), self.down_bias)

    def step(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> FusedLayers:
        return FusedLayers(hidden, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, self.inter, EPS)


def _angles(rng: np.random.Generator, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.from_numpy(rng.permutation(4000)[:rows].astype(np.float32))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def _norm64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _linear64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x @ w.double().T
    return out if b is None else out + b.double()


# (rows, hidden, heads, kv heads, head_dim, intermediate): one token; ragged decode sizes;
# past SILU_PARALLEL_ROWS; past the GEMM's 96-row block; a non-power-of-two hidden and widths.
SHAPES = [
    (1, 64, 4, 2, 16, 40),
    (5, 96, 6, 2, 16, 200),
    (13, 48, 3, 1, 32, 24),
    (SILU_PARALLEL_ROWS + 3, 80, 2, 2, 16, 72),
    (101, 64, 4, 1, 16, 56),
]


@pytest.mark.parametrize(("rows", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter"), SHAPES)
@pytest.mark.parametrize("biases", [False, True])
def test_a_fused_layer_matches_float64(rows: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                       inter: int, biases: bool) -> None:
    rng = np.random.default_rng(rows * 7 + hidden + biases)
    layer = Layer(rng, hidden, num_heads, num_kv_heads, head_dim, inter, biases)
    h0, delta = _rand(rng, rows, hidden, scale=2.0), _rand(rng, rows, hidden)
    cos, sin = _angles(rng, rows, head_dim)
    attn = _rand(rng, rows, num_heads, head_dim)

    # float64: the residual gets the previous MLP output (delta), then the attention input.
    x = h0.double() + delta.double()
    qkv = _linear64(_norm64(x, layer.input_norm), layer.qkv, layer.qkv_bias)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_ref = _rope64(qkv[:, :q_size].view(rows, num_heads, head_dim), cos, sin)
    k_ref = _rope64(qkv[:, q_size:q_size + kv_size].view(rows, num_kv_heads, head_dim), cos, sin)
    v_ref = qkv[:, q_size + kv_size:].view(rows, num_kv_heads, head_dim)
    x = x + _linear64(attn.double().view(rows, -1), layer.o, layer.o_bias)
    gate_up = _linear64(_norm64(x, layer.post_norm), layer.gate_up, layer.gate_up_bias)
    mlp = _linear64(_silu64(gate_up[:, :inter]) * gate_up[:, inter:], layer.down, layer.down_bias)

    hidden_t = h0.clone()
    step = layer.step(hidden_t, cos, sin)
    step.down[:] = delta.numpy()   # as if a previous layer's MLP had written it
    step._pending = True
    q, k, v = step.attention_input(layer.weights)
    torch.testing.assert_close(q.double(), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.double(), v_ref, rtol=1e-5, atol=1e-5)
    step.attention_output_mlp(layer.weights, attn)
    torch.testing.assert_close(hidden_t.double(), x, rtol=1e-5, atol=1e-5)   # the o projection is in the stream
    step.finish()
    torch.testing.assert_close(hidden_t.double(), x + mlp, rtol=1e-5, atol=1e-5)
    step.finish()   # nothing pending: adds nothing twice
    torch.testing.assert_close(hidden_t.double(), x + mlp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, SILU_PARALLEL_ROWS + 1])
def test_a_fused_layer_is_the_separate_kernels_chained(rows: int) -> None:
    """The same floats as the kernels run one by one (norm, GEMM, RoPE, SiLU·mul, GEMM...)."""
    rng = np.random.default_rng(rows)
    layer = Layer(rng, 96, 6, 2, 16, 200, biases=True)
    h0 = _rand(rng, rows, 96)
    cos, sin = _angles(rng, rows, 16)
    attn = _rand(rng, rows, 6, 16)
    w = layer.weights

    hidden = h0.clone()
    normed = rms_norm(hidden, layer.input_norm, EPS)
    qkv = gemm.gemm(normed, torch.from_numpy(w.qkv), layer.qkv_bias)
    q, k, v = torch.empty(rows, 6, 16), torch.empty(rows, 2, 16), torch.empty(rows, 2, 16)
    rope_qkv(qkv, cos, sin, 6, 2, 16, q, k, v)
    o = gemm.gemm(attn.view(rows, -1), torch.from_numpy(w.o), layer.o_bias)
    normed = rms_norm(hidden, layer.post_norm, EPS, residual_delta=o)
    act = silu_mul(gemm.gemm(normed, torch.from_numpy(w.gate_up), layer.gate_up_bias))
    hidden += gemm.gemm(act, torch.from_numpy(w.down), layer.down_bias)

    fused_hidden = h0.clone()
    step = layer.step(fused_hidden, cos, sin)
    fq, fk, fv = step.attention_input(w)
    assert torch.equal(fq, q) and torch.equal(fk, k) and torch.equal(fv, v)
    step.attention_output_mlp(w, attn)
    step.finish()
    assert torch.equal(fused_hidden, hidden)


def test_fused_layers_check_their_inputs() -> None:
    rng = np.random.default_rng(0)
    layer = Layer(rng, 64, 4, 2, 16, 40, biases=False)
    plain = torch.zeros(64, 64)
    with pytest.raises(KernelInputError, match="panel-packed"):
        LayerWeights.of(layer.input_norm, plain, None, gemm.pack(layer.o), None, layer.post_norm,
                        gemm.pack(layer.gate_up), None, gemm.pack(layer.down), None)
    with pytest.raises(KernelInputError, match="chain"):   # o projects to another width than hidden
        LayerWeights.of(layer.input_norm, gemm.pack(layer.qkv), None, gemm.pack(torch.zeros(32, 64)), None,
                        layer.post_norm, gemm.pack(layer.gate_up), None, gemm.pack(layer.down), None)
    with pytest.raises(KernelInputError, match="bias"):
        LayerWeights.of(layer.input_norm, gemm.pack(layer.qkv), torch.zeros(5), gemm.pack(layer.o), None,
                        layer.post_norm, gemm.pack(layer.gate_up), None, gemm.pack(layer.down), None)
    cos, sin = _angles(rng, 3, 16)
    with pytest.raises(KernelInputError, match="cos/sin"):
        FusedLayers(torch.zeros(3, 64), cos[:2], sin[:2], 4, 2, 16, 40, EPS)
    step = layer.step(torch.zeros(3, 64), cos, sin)
    with pytest.raises(KernelInputError, match="attention output"):
        step.attention_output_mlp(layer.weights, torch.zeros(3, 5))
    other = Layer(rng, 64, 4, 2, 16, 48, biases=False)   # another intermediate size
    with pytest.raises(KernelInputError, match="gate/up"):
        step.attention_output_mlp(other.weights, torch.zeros(3, 4, 16))
