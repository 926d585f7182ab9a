"""The float32 GEMM's register tile (`kernels.cpu.gemm`): up to 6 rows x 16 columns of the
output held in AVX2-sized vector registers while one K range of the inputs streams through.

Numba has no SIMD types and its auto-vectoriser will not keep a 6 x 16 accumulator block in
registers, so the tile is written as LLVM IR: twelve `<8 x float>` accumulators, and per step
of K two vector loads of the packed weight panel (16 consecutive floats), one scalar load and
broadcast per input row, and `llvm.fma` into each accumulator. LLVM turns that into the classic
AVX2 micro-kernel (`vmovups` x 2, `vbroadcastss` x 6, `vfmadd231ps` x 12 per step; 15 of the 16
ymm registers), which keeps both FMA ports busy: two loads per FMA pair is under the load
ports' rate. Fewer rows (the last tile of a ragged M) use the same code with fewer
accumulators; the accumulators are plain allocas that LLVM's SROA promotes to registers.

On a CPU without AVX2/FMA (Numba compiles for the host) LLVM lowers the same IR to whatever the
host has, so the results stay correct, only slower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

PANEL = 16          # output columns per packed weight panel (two 8-float vectors)
MAX_TILE_ROWS = 6   # 12 accumulators + 2 weight vectors + 1 broadcast = 15 of AVX2's 16 registers

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _make_tile(rows: int) -> Callable[..., Any]:
    """The tile intrinsic for `rows` output rows (1 to `MAX_TILE_ROWS`)."""

    @intrinsic
    def tile(typingctx: Any, a: Any, a_off: Any, lda: Any, b: Any, b_off: Any, k_len: Any, c: Any, c_off: Any,
             ldc: Any, src: Any, src_off: Any, src_stride: Any, zero_init: Any, prefetch_off: Any) -> Any:
        """c[r, 0:16] = init[r] + sum over k < k_len of a[r, k] * b[k, 0:16], for r < rows, where
        a, b and c are element offsets into the arrays' data (row strides lda, 16, ldc) and
        init[r] is zero (`zero_init`) or src[src_off + r * src_stride :][:16] (a running sum in
        c itself, or a bias row with stride 0). Plain pointer arithmetic: the caller (`gemm`)
        keeps every access inside its arrays."""
        sig = types.void(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init,
                         prefetch_off)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            (a_v, a_off_v, lda_v, b_v, b_off_v, k_v, c_v, c_off_v, ldc_v,
             src_v, src_off_v, src_stride_v, zero_v, prefetch_v) = args
            a_ty, b_ty, c_ty, src_ty = signature.args[0], signature.args[3], signature.args[6], signature.args[9]
            a_data = context.make_array(a_ty)(context, builder, a_v).data
            b_data = context.make_array(b_ty)(context, builder, b_v).data
            c_data = context.make_array(c_ty)(context, builder, c_v).data
            src_data = context.make_array(src_ty)(context, builder, src_v).data
            vec_ptr = _V8.as_pointer()
            byte_ptr = ir.IntType(8).as_pointer()
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, _I32, _I32, _I32]), "llvm.prefetch.p0")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8, _V8, _V8]),
                                                 "llvm.fma.v8f32")

            def at(base: Any, offset: Any, row: int, stride: Any) -> Any:
                return builder.gep(base, [builder.add(offset, builder.mul(ir.Constant(_I64, row), stride))])

            def load8(ptr: Any, half: int) -> Any:
                return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(_I64, 8 * half)]), vec_ptr), align=4)

            accs = [[cgutils.alloca_once(builder, _V8) for _ in range(2)] for _ in range(rows)]
            with builder.if_else(builder.icmp_unsigned("!=", zero_v, ir.Constant(zero_v.type, 0))) as (zero, load):
                with zero:
                    for row_accs in accs:
                        for acc in row_accs:
                            builder.store(ir.Constant(_V8, [0.0] * 8), acc)
                with load:
                    for r, row_accs in enumerate(accs):
                        init = at(src_data, src_off_v, r, src_stride_v)
                        for half, acc in enumerate(row_accs):
                            builder.store(load8(init, half), acc)

            a_rows = [at(a_data, a_off_v, r, lda_v) for r in range(rows)]
            panel = builder.gep(b_data, [b_off_v])
            undef = ir.Constant(_V8, ir.Undefined)
            splat = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
            with cgutils.for_range(builder, k_v) as loop:
                k = loop.index
                b_row = builder.gep(panel, [builder.mul(k, ir.Constant(_I64, PANEL))])
                b_vecs = [load8(b_row, 0), load8(b_row, 1)]
                ahead = builder.bitcast(builder.gep(b_row, [prefetch_v]), byte_ptr)
                builder.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
                for a_row, row_accs in zip(a_rows, accs):
                    scalar = builder.load(builder.gep(a_row, [k]), align=4)
                    bcast = builder.shuffle_vector(builder.insert_element(undef, scalar, ir.Constant(_I32, 0)),
                                                   undef, splat)
                    for b_vec, acc in zip(b_vecs, row_accs):
                        builder.store(builder.call(fma, [bcast, b_vec, builder.load(acc)]), acc)

            for r, row_accs in enumerate(accs):
                c_row = at(c_data, c_off_v, r, ldc_v)
                for half, acc in enumerate(row_accs):
                    dst = builder.gep(c_row, [ir.Constant(_I64, 8 * half)])
                    builder.store(builder.load(acc), builder.bitcast(dst, vec_ptr), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


tile_1, tile_2, tile_3, tile_4, tile_5, tile_6 = (_make_tile(rows) for rows in range(1, MAX_TILE_ROWS + 1))
