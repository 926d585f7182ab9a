"""The online-softmax step of the flash prefill kernel (`prefill_flash.py`) for one query row and
one 16-key tile, written as LLVM IR through Numba: the row's 16 scores as two `<8 x float>`
vectors, their max, sixteen exps and their sum, all in vector registers.

Why IR: the two products around it run at the FMA peak through the GEMM's register tile, and
the same step in plain Numba (a max loop, a loop of `_tile.exp_f32`, a sum) stayed scalar: 8.4
µs of a 13.5 µs key tile of 96 rows on the project's AVX2 host (exp is 1 per score against 256
FLOP of the products). The exp is `_tile.exp_f32`'s (the same Cody-Waite reduction, Cephes
polynomial and clamps), operation for operation, on eight lanes.

The caller must be compiled without fast-math: Numba applies its fast-math flags to every
floating-point instruction of the function, the intrinsic's included, and `reassoc` folds the
round-to-integer trick (x + 1.5 * 2**23 - 1.5 * 2**23) away (seen: exps off by up to 2x).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_I32V8 = ir.VectorType(ir.IntType(32), 8)
_I64 = ir.IntType(64)
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _splat(value: float) -> ir.Constant:
    return ir.Constant(_V8, [float(np.float32(value))] * 8)


def _vexp(builder: Any, fn: Any, x: Any) -> Any:
    """exp of eight floats, as `_tile.exp_f32` computes one (no fast-math flags: the two-constant
    reduction must stay two products)."""
    xc = builder.call(fn["min"], [builder.call(fn["max"], [x, _splat(-87.0)]), _splat(88.0)])
    shifter = _splat(1.5 * 2**23)
    shifted = builder.fadd(builder.fmul(xc, _splat(1.44269504088896341)), shifter)
    n = builder.fsub(shifted, shifter)
    r = builder.fsub(xc, builder.fmul(n, _splat(0.693359375)))
    r = builder.fsub(r, builder.fmul(n, _splat(-2.12194440e-4)))
    p = _splat(_POLY[0])
    for c in _POLY[1:]:
        p = builder.fadd(builder.fmul(p, r), _splat(c))
    bits = builder.sub(builder.bitcast(shifted, _I32V8), ir.Constant(_I32V8, [0x4B400000] * 8))
    pow2 = builder.bitcast(builder.shl(builder.add(bits, ir.Constant(_I32V8, [127] * 8)),
                                       ir.Constant(_I32V8, [23] * 8)), _V8)
    y = builder.fmul(builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), _splat(1.0)), pow2)
    y = builder.select(builder.fcmp_ordered("<", x, _splat(-87.0)), _splat(0.0), y)
    y = builder.select(builder.fcmp_ordered(">", x, _splat(88.0)), _splat(np.inf), y)
    return builder.select(builder.fcmp_unordered("uno", x, x), x, y)


@intrinsic
def softmax_row16(typingctx: Any, scores: Any, offset: Any, m: Any, l: Any, row: Any) -> Any:
    """One row's online-softmax step over 16 scores at `scores` element `offset` (masked keys
    already -inf): m_new = max(m[row], max of the scores); scores become exp(score - m_new);
    l[row] = l[row] * alpha + their sum, m[row] = m_new; returns alpha = exp(m_old - m_new),
    the factor the row's accumulator must be scaled by (0 on the first tile, where m_old is
    -inf). The tile must have a finite score unless m[row] is already finite."""
    sig = types.float32(scores, offset, m, l, row)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        s_v, off_v, m_v, l_v, row_v = args
        s_ty, m_ty, l_ty = signature.args[0], signature.args[2], signature.args[3]
        s_data = context.make_array(s_ty)(context, builder, s_v).data
        m_ptr = builder.gep(context.make_array(m_ty)(context, builder, m_v).data, [row_v])
        l_ptr = builder.gep(context.make_array(l_ty)(context, builder, l_v).data, [row_v])
        module = builder.module
        fn = {
            "max": cgutils.get_or_insert_function(module, ir.FunctionType(_V8, [_V8, _V8]), "llvm.maxnum.v8f32"),
            "min": cgutils.get_or_insert_function(module, ir.FunctionType(_V8, [_V8, _V8]), "llvm.minnum.v8f32"),
        }
        reduce_max = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_V8]),
                                                    "llvm.vector.reduce.fmax.v8f32")
        reduce_add = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_F32, _V8]),
                                                    "llvm.vector.reduce.fadd.v8f32")
        max_f32 = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_F32, _F32]), "llvm.maxnum.f32")
        ptrs = [builder.bitcast(builder.gep(s_data, [builder.add(off_v, ir.Constant(_I64, 8 * h))]),
                                _V8.as_pointer()) for h in range(2)]
        v = [builder.load(p, align=4) for p in ptrs]
        tile_max = builder.call(reduce_max, [builder.call(fn["max"], v)])
        m_old = builder.load(m_ptr)
        m_new = builder.call(max_f32, [m_old, tile_max])
        undef = ir.Constant(_V8, ir.Undefined)
        zeros = ir.Constant(_I32V8, [0] * 8)
        m_splat = builder.shuffle_vector(builder.insert_element(undef, m_new, ir.Constant(ir.IntType(32), 0)),
                                         undef, zeros)
        e = [_vexp(builder, fn, builder.fsub(x, m_splat)) for x in v]
        for ptr, value in zip(ptrs, e):
            builder.store(value, ptr, align=4)
        total = builder.call(reduce_add, [ir.Constant(_F32, 0.0), builder.fadd(e[0], e[1])], fastmath=("reassoc",))
        d_splat = builder.shuffle_vector(
            builder.insert_element(undef, builder.fsub(m_old, m_new), ir.Constant(ir.IntType(32), 0)), undef, zeros)
        alpha = builder.extract_element(_vexp(builder, fn, d_splat), ir.Constant(ir.IntType(32), 0))
        builder.store(builder.fadd(builder.fmul(builder.load(l_ptr), alpha), total), l_ptr)
        builder.store(m_new, m_ptr)
        return alpha

    return sig, codegen
