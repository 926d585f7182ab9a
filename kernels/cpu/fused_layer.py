"""A decoder layer's dense work between two attention calls, as two compiled calls on the CPU.

With the weights in panels (`gemm.pack`), a Llama/Qwen2 layer outside attention is: residual
add + RMSNorm, the q/k/v matmul, RoPE (before attention); the o matmul, residual add + RMSNorm,
the gate/up matmul, SiLU·mul, the down matmul (after). Run op by op from Python that is ~8
calls a layer (4 GEMMs, 2 norms, RoPE, 3 torch ops for SiLU·mul), each paying argument
checks, tensor-to-array conversions, an output allocation and a dispatch: ~10-15 µs apiece at
one row (the norms, RoPE and SiLU·mul alone ~3 ms of CPU time in a 135M model's ~45 ms
one-row decode step; 2-core AVX2 host, one thread, `bench/bench_decode_parts.py`). Here each side is one call into one
Numba function (`attention_input`, `attention_output_mlp`) that runs the same kernels in
sequence: the GEMMs' panel shares in `prange` loops (`gemm.gemm_share`, one parallel region
per matmul as before), the norm, RoPE and SiLU·mul between them on the calling thread (or,
SiLU·mul of many rows, in a parallel loop too), into scratch arrays made once per step shape
(`FusedLayers`): nothing is allocated per layer.

The arithmetic is that of the separate kernels (`rms_norm._rms_norm`, `rope._rope_qkv`,
`silu.silu_mul_rows`, the panel GEMM), so results are the same floats as running them one by
one; only SiLU differs from torch's, by float32 rounding (`silu.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange

from kernels._validate import KernelInputError
from kernels.cpu import gemm
from kernels.cpu._cache import njit_cached
from kernels.cpu.rms_norm import _rms_norm
from kernels.cpu.rope import _rope_qkv
from kernels.cpu.silu import silu_mul_rows

# Rows from which SiLU·mul runs in a parallel loop: below, one thread finishes it in a few µs
# (24 rows x 1536: ~50 µs vectorised) and a parallel region's wake-up costs as much.
SILU_PARALLEL_ROWS = 64
_NO_ROWS = np.zeros((0, 1), np.float32)
_NO_BIAS = np.zeros((1, 0), np.float32)


@njit_cached(parallel=True, error_model="numpy")
def _attention_input(hidden, delta, norm_w, eps, normed, qkv_panels, qkv_bias, qkv, cos, sin,
                     num_heads, num_kv_heads, q, k, v, num_chunks, row_block, k_block, prefetch):
    _rms_norm(hidden, delta, norm_w, eps, normed)
    num_panels = qkv_panels.shape[0]
    for c in prange(num_chunks):
        gemm.gemm_share(normed, qkv_panels, qkv_bias, qkv, c * num_panels // num_chunks,
                        (c + 1) * num_panels // num_chunks, row_block, k_block, prefetch)
    _rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, q, k, v)


@njit_cached(parallel=True, error_model="numpy")
def _attention_output_mlp(hidden, attn, o_panels, o_bias, o_out, post_w, eps, normed,
                          gu_panels, gu_bias, gu_out, act, down_panels, down_bias, down_out,
                          num_chunks, blocks, prefetch, silu_parallel):
    # blocks: int64 [3, 2], (row block, K block) of the o, gate/up and down GEMMs.
    rows = hidden.shape[0]
    num_panels = o_panels.shape[0]
    for c in prange(num_chunks):
        gemm.gemm_share(attn, o_panels, o_bias, o_out, c * num_panels // num_chunks,
                        (c + 1) * num_panels // num_chunks, blocks[0, 0], blocks[0, 1], prefetch)
    _rms_norm(hidden, o_out, post_w, eps, normed)
    num_panels = gu_panels.shape[0]
    for c in prange(num_chunks):
        gemm.gemm_share(normed, gu_panels, gu_bias, gu_out, c * num_panels // num_chunks,
                        (c + 1) * num_panels // num_chunks, blocks[1, 0], blocks[1, 1], prefetch)
    if silu_parallel:
        for c in prange(num_chunks):
            silu_mul_rows(gu_out, act, c * rows // num_chunks, (c + 1) * rows // num_chunks)
    else:
        silu_mul_rows(gu_out, act, 0, rows)
    num_panels = down_panels.shape[0]
    for c in prange(num_chunks):
        gemm.gemm_share(act, down_panels, down_bias, down_out, c * num_panels // num_chunks,
                        (c + 1) * num_panels // num_chunks, blocks[2, 0], blocks[2, 1], prefetch)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights as the arrays the fused kernels take: panels (`gemm.pack`),
    biases as `[1, width]` rows (`[1, 0]`: none), norm weights `[hidden]`; made once per model."""

    input_norm: np.ndarray
    qkv: np.ndarray
    qkv_bias: np.ndarray
    o: np.ndarray
    o_bias: np.ndarray
    post_norm: np.ndarray
    gate_up: np.ndarray
    gate_up_bias: np.ndarray
    down: np.ndarray
    down_bias: np.ndarray

    @classmethod
    def of(cls, input_norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None, o: torch.Tensor,
           o_bias: torch.Tensor | None, post_norm: torch.Tensor, gate_up: torch.Tensor,
           gate_up_bias: torch.Tensor | None, down: torch.Tensor, down_bias: torch.Tensor | None) -> LayerWeights:
        """From the model's tensors: float32 CPU, matmul weights panel-packed with whole panels
        (`KernelInputError` otherwise: the caller then keeps the op-by-op path)."""
        def panels(w: torch.Tensor) -> np.ndarray:
            if w.dim() != 3 or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
                raise KernelInputError(
                    f"a fused layer takes panel-packed float32 weights, got {tuple(w.shape)} {w.dtype}")
            return w.numpy()

        def bias(b: torch.Tensor | None, p: np.ndarray) -> np.ndarray:
            if b is None:
                return _NO_BIAS
            if b.shape != (p.shape[0] * gemm.PANEL,):
                raise KernelInputError(f"bias {tuple(b.shape)} does not fill the {p.shape[0]} panels")
            return np.ascontiguousarray(b.detach().float().numpy().reshape(1, -1))

        def vector(w: torch.Tensor) -> np.ndarray:
            if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 1:
                raise KernelInputError(f"a norm weight must be float32 [hidden] on the CPU, got {w.dtype}")
            return np.ascontiguousarray(w.numpy())

        p_qkv, p_o, p_gu, p_down = panels(qkv), panels(o), panels(gate_up), panels(down)
        hidden = p_qkv.shape[1]
        if (p_o.shape[0] * gemm.PANEL != hidden or p_gu.shape[1] != hidden or p_down.shape[0] * gemm.PANEL != hidden
                or p_down.shape[1] * 2 != p_gu.shape[0] * gemm.PANEL):
            raise KernelInputError("the layer's panels do not chain (hidden -> qkv, q -> hidden, hidden -> 2 x inter"
                                   " -> hidden)")
        return cls(vector(input_norm), p_qkv, bias(qkv_bias, p_qkv), p_o, bias(o_bias, p_o), vector(post_norm),
                   p_gu, bias(gate_up_bias, p_gu), p_down, bias(down_bias, p_down))


class FusedLayers:
    """One step's dense layer work (`attention_input`, `attention_output_mlp` per layer) over
    `rows` tokens whose residual stream is `hidden` (updated in place), with the step's RoPE
    angles `cos`/`sin` `[rows, head_dim // 2]`.

    The scratch arrays are sized for the step's rows and rewritten by every layer: each is
    consumed (by the next kernel, or by attention, which copies k/v into the pool and returns
    its own output) before the next layer writes it. The q, k, v tensors handed to attention
    are views of them."""

    def __init__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, eps: float) -> None:
        if hidden.dtype != torch.float32 or hidden.dim() != 2 or not hidden.is_contiguous():
            raise KernelInputError(f"hidden must be contiguous float32 [rows, hidden], got {hidden.dtype}")
        rows, width = hidden.shape
        self.rows = rows
        self.hidden = hidden.numpy()
        self.cos, self.sin = cos.contiguous().numpy(), sin.contiguous().numpy()
        if self.cos.shape != (rows, head_dim // 2) or self.sin.shape != self.cos.shape:
            raise KernelInputError(f"cos/sin must be [{rows}, {head_dim // 2}], got {self.cos.shape}")
        self.num_heads, self.num_kv_heads, self.eps = num_heads, num_kv_heads, float(eps)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        new = np.empty
        self.normed = new((rows, width), np.float32)
        self.qkv = new((rows, q_size + 2 * kv_size), np.float32)
        self.q_t = torch.empty(rows, num_heads, head_dim)
        self.k_t = torch.empty(rows, num_kv_heads, head_dim)
        self.v_t = torch.empty(rows, num_kv_heads, head_dim)
        self.q, self.k, self.v = self.q_t.numpy(), self.k_t.numpy(), self.v_t.numpy()
        self.o_out = new((rows, width), np.float32)
        self.gate_up = new((rows, 2 * intermediate), np.float32)
        self.act = new((rows, intermediate), np.float32)
        self.down = new((rows, width), np.float32)
        self.num_chunks = numba.get_num_threads()
        self.qkv_blocks = gemm.blocks(rows, width)
        self.blocks = np.array([gemm.blocks(rows, q_size), gemm.blocks(rows, width),
                                gemm.blocks(rows, intermediate)], np.int64)
        self.prefetch = gemm.prefetch_ahead(rows)
        self.silu_parallel = rows >= SILU_PARALLEL_ROWS
        self._pending = False   # whether `down` holds a layer's output not yet added to hidden

    def attention_input(self, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add the previous layer's MLP output to the residual stream, normalise, project to
        q/k/v and rotate q and k: returns q `[rows, heads, head_dim]`, k and v `[rows, kv_heads,
        head_dim]` (views of this step's scratch)."""
        if w.qkv.shape[0] * gemm.PANEL != self.qkv.shape[1] or w.input_norm.shape[0] != self.hidden.shape[1]:
            raise KernelInputError(f"the layer's q/k/v panels {w.qkv.shape} do not match the step's {self.qkv.shape}")
        if self.rows:
            _attention_input(self.hidden, self.down if self._pending else _NO_ROWS, w.input_norm, self.eps,
                             self.normed, w.qkv, w.qkv_bias, self.qkv, self.cos, self.sin, self.num_heads,
                             self.num_kv_heads, self.q, self.k, self.v, self.num_chunks, self.qkv_blocks[0],
                             self.qkv_blocks[1], self.prefetch)
        self._pending = False
        return self.q_t, self.k_t, self.v_t

    def attention_output_mlp(self, w: LayerWeights, attn: torch.Tensor) -> None:
        """Project attention's output `[rows, heads, head_dim]` (float32), add it to the
        residual stream, normalise and run the MLP; its output is added by the next
        `attention_input` (or `finish`)."""
        if attn.dtype != torch.float32 or attn.numel() != self.rows * w.o.shape[1] or not attn.is_contiguous():
            raise KernelInputError(f"attention output must be contiguous float32 with {w.o.shape[1]} features a row")
        if w.gate_up.shape[0] * gemm.PANEL != self.gate_up.shape[1]:
            raise KernelInputError(f"the layer's gate/up panels {w.gate_up.shape} do not match {self.gate_up.shape}")
        if self.rows:
            _attention_output_mlp(self.hidden, attn.numpy().reshape(self.rows, -1), w.o, w.o_bias, self.o_out,
                                  w.post_norm, self.eps, self.normed, w.gate_up, w.gate_up_bias, self.gate_up,
                                  self.act, w.down, w.down_bias, self.down, self.num_chunks, self.blocks,
                                  self.prefetch, self.silu_parallel)
        self._pending = True

    def finish(self) -> None:
        """Add the last layer's MLP output to the residual stream."""
        if self._pending:
            self.hidden += self.down
            self._pending = False
