"""SwiGLU's `silu(gate) * up` for float32 rows `[gate | up]`, in a loop LLVM vectorises.

Numba lowers `math.exp` to a call into libm per element, which keeps the loop scalar (why the
model kept torch's two vectorised ops for this: a plain Numba loop measured 3-10x slower).
Here `exp(-gate)` is computed in the loop itself, the classic way float32 libraries do it:
`exp(t) = 2**n * exp(r)` with `n = round(t / ln 2)` and `|r| <= ln(2) / 2`, `exp(r)` a degree-7
polynomial (Cephes' `expf` coefficients, ~1 ulp over the reduced range) and `2**n` built by
writing `n + 127` into a float's exponent bits (`_pow2`). Every step is a plain float or
integer operation, so the loop compiles to 8-wide AVX2 code — provided the calling kernel is
compiled with `error_model="numpy"`: Python's error model checks the division for a zero
divisor per element, which keeps the loop scalar (measured 24 x 1536: 295 µs scalar, 92 µs
vectorised, torch's chunk + silu + mul ~3x slower still at one thread). The loop also runs
inside the fused layer kernels (`fused_layer.py`) with no call into torch.

`silu(g) = g / (1 + exp(-g))`; `-g` is clamped to [-87, 88] first (exp stays a normal float:
`g / (1 + exp(88))` is ~6e-37 * g where the exact value is smaller still, and for `g > 87`
the result is `g` to float32 precision either way). Results agree with the float64 formula to
a few float32 ulps (tests/kernels/test_cpu_silu.py), as torch's own vectorised `silu` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels._validate import KernelInputError
from kernels.cpu._cache import njit_cached
from kernels.cpu._dense import check_rows, rows_f32

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)        # ln 2 split in two: n * _LN2_HI is exact for |n| < 2**9
_LN2_LO = np.float32(-2.12194440e-4)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_LO = np.float32(-87.0)
_HI = np.float32(88.0)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)


@intrinsic
def _pow2(typingctx: Any, n: Any) -> Any:
    """2**n as a float32, for an int32 `n` in [-126, 127]: `n + 127` in the exponent field."""
    sig = types.float32(types.int32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        biased = builder.add(args[0], ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return sig, codegen


@njit_cached(inline="always")
def _silu(g):
    # g: float32; every constant float32 so the arithmetic stays float32 (8 lanes, not 4).
    t = min(max(-g, _LO), _HI)
    n = np.floor(t * _LOG2E + _HALF)
    r = t - n * _LN2_HI - n * _LN2_LO
    r2 = r * r
    p = ((((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * r2 + r) + _ONE
    return g / (_ONE + p * _pow2(np.int32(n)))


@njit_cached(inline="always")
def silu_mul_rows(gate_up, out, first, stop):
    # Rows [first, stop): out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j], float32.
    inter = out.shape[1]
    for r in range(first, stop):
        src = gate_up[r]
        dst = out[r]
        for j in range(inter):
            dst[j] = _silu(src[j]) * src[inter + j]


@njit_cached(error_model="numpy")
def _silu_mul(gate_up, out):
    silu_mul_rows(gate_up, out, 0, out.shape[0])


def silu_mul(gate_up: Any, out: Any | None = None) -> Any:
    """`silu(gate) * up` of float32 `gate_up` `[rows, 2 * inter]` (gate columns first, as the
    model's fused gate/up matmul writes them) into `out` `[rows, inter]` (new when None).
    CPU tensors or arrays, C-contiguous; runs on the calling thread."""
    x = rows_f32("gate_up", gate_up)
    rows, width = x.shape
    if width % 2:
        raise KernelInputError(f"gate_up must have an even width (gate then up), got {width}")
    if out is None:
        out = gate_up.new_empty((rows, width // 2)) if hasattr(gate_up, "new_empty") else np.empty(
            (rows, width // 2), np.float32)
    o = rows_f32("out", out)
    check_rows("out", o, (rows, width // 2))
    if rows:
        _silu_mul(x, o)
    return out
