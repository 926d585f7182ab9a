"""Math and register operations of the kernels as Numba CUDA intrinsics (GPU only).

- tensor cores: `mma.sync.aligned.m16n8k16` with float32 accumulators, for fp16 and bf16
  operands (fragment layouts: PTX ISA, "Matrix fragments for mma.m16n8k16"), and
  `movmatrix` (transpose an 8x8 16-bit tile held one row-pair per lane);
- register shuffles: `prmt` (byte permute) to pair the same element of two words, packed
  float32 → fp16x2 / bf16x2 conversions (round to nearest even), and back to float32;
- `ex2`: `ex2.approx.ftz.f32` (2 ulp; exp2(-inf) = +0, which the masked softmax relies on);
- warp shuffles, called warp-uniformly (every lane takes part).
The warp-collective asm (`mma.sync`, `movmatrix`; `ldmatrix` in `_ops_gpu`) is emitted
`sideeffect` + `convergent` (`_collective_asm`) so the compiler can neither move it into or
out of control flow, duplicate it, nor drop it.
Memory operations are in `_ops_gpu.py`; `_ops_sim.py` has the simulator's twins of both.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import cuda, types

from kernels.cuda._ops_gpu import _F32, _I32, _asm, _collective_asm, _struct_to_tuple, intrinsic

_FULL_MASK = 0xFFFFFFFF


def _mma(shape: str, kind: str, num_a: int = 4, num_b: int = 2) -> Any:
    """mma.sync.aligned.<shape>.row.col.f32.<kind>.<kind>.f32 → 4 float32 accumulators."""
    n = 4 + num_a + num_b + 4
    d = ",".join(f"${i}" for i in range(4))
    a = ",".join(f"${i}" for i in range(4, 4 + num_a))
    b = ",".join(f"${i}" for i in range(4 + num_a, 4 + num_a + num_b))
    c = ",".join(f"${i}" for i in range(4 + num_a + num_b, n))
    text = f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 {{{d}}}, {{{a}}}, {{{b}}}, {{{c}}};"
    constraints = ",".join(["=f"] * 4 + ["r"] * (num_a + num_b) + ["f"] * 4)
    ret = types.UniTuple(types.float32, 4)
    want = [types.uint32] * (num_a + num_b) + [types.float32] * 4

    def codegen(context: Any, builder: Any, sig: Any, llargs: list[Any]) -> Any:
        vals = [context.cast(builder, v, t, w) for v, t, w in zip(llargs, sig.args, want)]
        out = _collective_asm(builder, ir.LiteralStructType([_F32] * 4), vals, text,
                              constraints)
        return _struct_to_tuple(context, builder, ret, out, 4)

    @intrinsic
    def mma(typingctx: Any, a0: Any, a1: Any, a2: Any, a3: Any, b0: Any, b1: Any, c0: Any,
            c1: Any, c2: Any, c3: Any) -> Any:
        return ret(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    return mma


mma16816_f16 = _mma("m16n8k16", "f16")
mma16816_bf16 = _mma("m16n8k16", "bf16")


@intrinsic
def movmatrix(typingctx: Any, word: Any) -> Any:
    """Transpose an 8x8 matrix of 16-bit elements held one row-pair per lane: lane (g, c)
    holds row g, columns 2c and 2c+1, before and after (`movmatrix.sync.aligned.m8n8.trans`)."""
    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        w = context.cast(builder, args[0], sig.args[0], types.uint32)
        return _collective_asm(builder, _I32, [w], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
                               "=r,r")

    return types.uint32(word), codegen


# --------------------------------------------------------------------------------------------
# Register-level conversions
# --------------------------------------------------------------------------------------------

def _prmt(selector: int) -> Any:
    text = f"prmt.b32 $0, $1, $2, {selector:#x};"

    @intrinsic
    def prmt(typingctx: Any, a: Any, b: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
            return _asm(builder, _I32, vals, text, "=r,r,r")

        return types.uint32(a, b), codegen

    return prmt


# {a.lo, b.lo} and {a.hi, b.hi}: the same 16-bit element of two 32-bit words, side by side.
pack_lo = _prmt(0x5410)
pack_hi = _prmt(0x7632)


def _pack_f32x2(kind: str) -> Any:
    # cvt.rn.<kind>x2.f32 d, a, b puts a in the HIGH half: pass (hi, lo).
    text = f"cvt.rn.{kind}x2.f32 $0, $2, $1;"

    @intrinsic
    def pack(typingctx: Any, lo: Any, hi: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            return _asm(builder, _I32, vals, text, "=r,f,f")

        return types.uint32(lo, hi), codegen

    return pack


f32x2_to_f16x2 = _pack_f32x2("f16")


f32x2_to_bf16x2 = _pack_f32x2("bf16")


def _unpack(kind: str) -> Any:
    ret = types.UniTuple(types.float32, 2)

    @intrinsic
    def unpack(typingctx: Any, word: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            w = context.cast(builder, args[0], sig.args[0], types.uint32)
            if kind == "f16":
                text = "{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}"
                out = _asm(builder, ir.LiteralStructType([_F32, _F32]), [w], text, "=f,=f,r")
                return _struct_to_tuple(context, builder, ret, out, 2)
            # bf16 is the top half of a float32: shift / mask the bits back into place.
            lo = builder.bitcast(builder.shl(w, ir.Constant(_I32, 16)), _F32)
            hi = builder.bitcast(builder.and_(w, ir.Constant(_I32, 0xFFFF0000)), _F32)
            return context.make_tuple(builder, ret, [lo, hi])

        return ret(word), codegen

    return unpack


f16x2_to_f32 = _unpack("f16")
bf16x2_to_f32 = _unpack("bf16")


@intrinsic
def ex2(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return _asm(builder, _F32, [v], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

    return types.float32(x), codegen


@intrinsic
def bits_f32(typingctx: Any, x: Any) -> Any:
    """A uint32 bit pattern as float32 (float32 caches travel as 32-bit words)."""
    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), _F32)

    return types.float32(x), codegen


# --------------------------------------------------------------------------------------------
# Warp shuffles (every lane of the warp takes part: the kernels call them warp-uniformly)
# --------------------------------------------------------------------------------------------

@cuda.jit(device=True, forceinline=True)
def shfl_xor(value: Any, lane_mask: Any) -> Any:
    return cuda.shfl_xor_sync(_FULL_MASK, value, lane_mask)


@cuda.jit(device=True, forceinline=True)
def shfl_idx(value: Any, src_lane: Any) -> Any:
    return cuda.shfl_sync(_FULL_MASK, value, src_lane)
