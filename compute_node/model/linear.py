"""The model's matmuls on the CPU: weights reordered once for oneDNN instead of `F.linear`.

`F.linear` on plain float32 weights goes to MKL's sgemm, which on the decode shapes of a serving
step (a few rows against every weight, `[tokens, hidden] @ [hidden, out]` with tokens ≪ hidden)
runs far below what the cores can do: on a 2-core AMD EPYC VM one decode step of a 135M model
(4 matmuls × 30 layers + the LM head, 8 rows) took 75.5 ms with `F.linear` and 37.8 ms with the
same weights reordered into oneDNN's blocked layout (`bench/bench_linear.py`; 1.4x at 512 rows).
oneDNN is the library torch itself uses for this (its CPU inductor packs weights the same way,
and so do Intel's extension and vLLM's CPU backend); the ops are torch's own
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), so nothing else is installed.

The arithmetic is the same float32 (or bfloat16) dot products in another order: results differ
from `F.linear` by float rounding (~1e-6 relative in float32), which is why the model tests
compare tokens with transformers under the near-tie rule rather than bit for bit.

Small weights stay plain: a oneDNN call has a fixed cost of ~20 µs where `F.linear` on a matrix
that sits in cache takes 5–15 µs (256 × 256 at one row: 24 vs 10 µs), so packing pays from
about a megabyte of float32 up, the size at which a model's weights stream from memory each
step (`MIN_PACKED_ELEMENTS`; the 135M model's smallest, o_proj, is 576 × 576).

A packed weight is an opaque oneDNN tensor: it can only be multiplied (`linear`), not indexed,
so a tied LM head is packed as a copy beside the embedding it shares values with.

On an AVX2 CPU without AVX-512 float32 weights are packed for the project's own GEMM instead
(`kernels.cpu.gemm`: 16-column panels, a 6 x 16 register tile, one contiguous share of the
panels per thread), which runs decode-sized matmuls faster than oneDNN does there: oneDNN's
small-M path reaches ~60% of the FMA peak on 16-64 rows where its prefill-sized path reaches
~100%. Measured on the 2-vCPU AMD EPYC host (`bench/bench_linear.py --backends onednn,panels
--no-head`, 30 layers of the 135M shape, two threads, quiet host, 2026-12-07 21:48): 1.32x
oneDNN's speed at one row, 1.32-1.43x at 16-64 rows, 1.00x at 512 (BENCHMARKS.md, "The panel
GEMM"). With AVX-512 oneDNN computes twice as wide as
the 8-float tile, so it keeps the weights there. A panel-packed weight is a plain 3-D float32
tensor `[out / 16, in, 16]` (`is_packed`, `unpack` tell the two kinds apart).
"""

from __future__ import annotations

import functools
import platform

import llvmlite.binding as llvm
import torch
import torch.nn.functional as F

from kernels.cpu import gemm as panel_gemm

# The dtypes oneDNN runs on x86 CPUs: float32 everywhere; bfloat16 only with AVX-512 (BW, VL,
# DQ; AVX512_BF16 natively) or AVX-NE-CONVERT; on a plain AVX2 CPU its reorder refuses bfloat16,
# so `onednn_available` is asked per dtype. float16 is left on F.linear.
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The batch the weight layout is chosen for; the packed weight serves any number of rows. 64
# rather than 8: on a 135M model's whole engine (bench_vs_vllm.py's workloads, the two
# alternated in one process four times, 2026-12-05) the mixed prefill-heavy batch ran 7% faster
# (145 vs 136 tok/s mean) and decode-bound runs the same (shared prefix 262 vs 260, batch 1
# 33.8 vs 33.3); with every layer's weights cold, 1,216 rows take 1.33 s vs 1.51 s a step.
BATCH_HINT = 64
MIN_PACKED_ELEMENTS = 1 << 18   # 512 x 512: smaller weights keep F.linear (module docstring)


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build can reorder and run packed linear weights of `dtype` (it has
    oneDNN and the ops work on this CPU for that dtype): checked once per dtype on a tiny
    weight. x86-64 only: that is where the gain was measured; Arm builds route oneDNN through
    other libraries and keep `F.linear`."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 4, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 4, dtype=dtype), pack_onednn(w), None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out.float(), torch.full((1, 4), 4.0)))


@functools.cache
def panels_preferred() -> bool:
    """Whether float32 weights go to the panel GEMM rather than oneDNN: an x86-64 CPU with AVX2
    and FMA but no AVX-512 (the host Numba compiles the tile for; module docstring)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx2") and features.get("fma") and not features.get("avx512f"))


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on `device` are worth packing: the CPU, float32 (panels or
    oneDNN) or bfloat16 (where this CPU has oneDNN's bfloat16 path)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    return (dtype == torch.float32 and panels_preferred()) or onednn_available(dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out_features, in_features]` packed for the faster of the two GEMMs here: panels
    (`panels_preferred`, float32, `out_features` a multiple of the panel width) or oneDNN's
    layout (an opaque tensor); `weight` itself where neither applies."""
    if weight.dtype == torch.float32 and panels_preferred() and weight.shape[0] % panel_gemm.PANEL == 0:
        return pack_panels(weight)
    return pack_onednn(weight) if onednn_available(weight.dtype) else weight


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered for oneDNN (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 `weight` with `out_features` a multiple of 16 as the panel GEMM's
    `[out / 16, in, 16]` (a plain tensor: `is_packed` knows it by its three dims)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[0] % panel_gemm.PANEL:
        raise ValueError(f"panels take a float32 [out, in] weight with out a multiple of {panel_gemm.PANEL}, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    return panel_gemm.pack(weight)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` was packed (`pack`): oneDNN's opaque tensor or the panels' 3-D one."""
    return weight.is_mkldnn or weight.dim() == 3


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """The plain `[out_features, in_features]` weight of a packed one (values unchanged), or
    `weight` itself when it is plain."""
    if weight.is_mkldnn:
        return weight.to_dense()
    if weight.dim() == 3:
        num_panels, in_features, width = weight.shape
        return weight.transpose(1, 2).reshape(num_panels * width, in_features).contiguous()
    return weight


def pack_if_large(weight: torch.Tensor) -> torch.Tensor:
    """`pack(weight)` when it has at least `MIN_PACKED_ELEMENTS` elements (and is not packed
    yet), else `weight`."""
    return pack(weight) if not is_packed(weight) and weight.numel() >= MIN_PACKED_ELEMENTS else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, through the panel GEMM or oneDNN when `weight` was packed, else
    `F.linear`."""
    if weight.dim() == 3:
        return panel_gemm.gemm(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
