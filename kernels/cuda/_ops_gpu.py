"""Machine-level building blocks of the attention kernels, as Numba CUDA intrinsics (GPU only).

Numba has no vector loads, tensor-core instructions or byte permutes, and its array indexing
costs 64-bit index arithmetic with wraparound checks per element. These intrinsics emit the
PTX directly, so a kernel reads memory through one 64-bit base address plus small offsets
(ptxas folds constant offsets into the load) and issues one instruction per 16 bytes:

- memory: addresses are plain int64 (`tensor.data_ptr()` passed by the host wrapper);
  `ld_kv_*` are the streaming K/V loads (`ld.global.nc.L2::128B`: read-only path, whole
  128-byte line fetched into L2 because the warp reads the rest of it next); `ld_*` are the
  other read-only loads (queries, tables, lengths, split-K partials); `st_*` plain stores.
  Every load is read-only for the kernel's lifetime, which `.nc` requires.
- tensor cores: `mma.sync.aligned` m16n8k16 and m16n8k8 with float32 accumulators, for fp16
  and bf16 operands (fragment layouts in the PTX ISA, "Matrix fragments for mma.m16n8k16").
- register shuffles: `prmt` (byte permute) to pair the same element of two tokens, packed
  float32 → fp16x2/bf16x2 conversions, and fp16x2/bf16x2 → float32 unpacking.
- `ex2`: `ex2.approx.ftz.f32` (2 ulp; exp2(-inf) = +0, which the masked softmax relies on).

`kernels/cuda/_ops_sim.py` implements the same names for Numba's simulator; `_ops.py` picks
one of the two at import, so kernels have one source.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import cuda, types

try:  # numba-cuda >= 0.20 has its own extension API; older releases share numba's
    from numba.cuda.extending import intrinsic
except ImportError:  # pragma: no cover - depends on the installed numba-cuda
    from numba.core.extending import intrinsic

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _bits(t: ir.Type) -> int:
    return 32 if isinstance(t, ir.FloatType) else t.width
_FULL_MASK = 0xFFFFFFFF


def _global_ptr(builder: Any, addr: Any, elem: ir.Type) -> Any:
    return builder.inttoptr(addr, ir.PointerType(elem, 1))


def _struct_to_tuple(context: Any, builder: Any, tuple_type: Any, value: Any, n: int) -> Any:
    return context.make_tuple(builder, tuple_type, [builder.extract_value(value, i) for i in range(n)])


def _asm(builder: Any, ret: ir.Type, args: list[Any], text: str, constraints: str) -> Any:
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(ir.InlineAsm(fnty, text, constraints), args)


# --------------------------------------------------------------------------------------------
# Loads and stores
# --------------------------------------------------------------------------------------------

def _kv_load(width: int) -> Any:
    """ld.global.nc.L2::128B.{v4,v2,}.u32: the K/V stream (width = number of 32-bit words)."""
    ret_type = types.UniTuple(types.uint32, width) if width > 1 else types.uint32
    outs = ",".join(f"${i}" for i in range(width))
    vec = {4: ".v4", 2: ".v2", 1: ""}[width]
    text = (f"ld.global.nc.L2::128B{vec}.u32 {{{outs}}}, [${width}];" if width > 1
            else "ld.global.nc.L2::128B.u32 $0, [$1];")
    constraints = ",".join(["=r"] * width) + ",l"

    @intrinsic
    def load(typingctx: Any, addr: Any) -> Any:
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            a = builder.sext(args[0], _I64) if args[0].type.width < 64 else args[0]
            if width == 1:
                return _asm(builder, _I32, [a], text, constraints)
            value = _asm(builder, ir.LiteralStructType([_I32] * width), [a], text, constraints)
            return _struct_to_tuple(context, builder, sig.return_type, value, width)

        return ret_type(addr), codegen

    return load


ld_kv_v4 = _kv_load(4)
ld_kv_v2 = _kv_load(2)
ld_kv_u32 = _kv_load(1)


def _plain_load(elem: ir.Type, numba_elem: Any, width: int) -> Any:
    """Read-only (invariant) load of `width` elements at a 4/8/16-byte aligned address."""
    ret_type = types.UniTuple(numba_elem, width) if width > 1 else numba_elem

    @intrinsic
    def load(typingctx: Any, addr: Any) -> Any:
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            a = builder.sext(args[0], _I64) if args[0].type.width < 64 else args[0]
            vty = ir.VectorType(elem, width) if width > 1 else elem
            inst = builder.load(_global_ptr(builder, a, vty), align=width * _bits(elem) // 8)
            inst.set_metadata("invariant.load", builder.module.add_metadata([]))
            if width == 1:
                return inst
            parts = [builder.extract_element(inst, ir.Constant(_I32, i)) for i in range(width)]
            return context.make_tuple(builder, sig.return_type, parts)

        return ret_type(addr), codegen

    return load


ld_v4 = _plain_load(_I32, types.uint32, 4)
ld_v2 = _plain_load(_I32, types.uint32, 2)
ld_u32 = _plain_load(_I32, types.uint32, 1)
ld_s32 = _plain_load(_I32, types.int32, 1)
ld_s64 = _plain_load(_I64, types.int64, 1)
ld_f32 = _plain_load(_F32, types.float32, 1)
ld_f32x4 = _plain_load(_F32, types.float32, 4)


def _store_codegen(elem: ir.Type, numba_elem: Any, width: int) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        a = builder.sext(args[0], _I64) if args[0].type.width < 64 else args[0]
        vals = [context.cast(builder, v, t, numba_elem) for v, t in zip(args[1:], sig.args[1:])]
        if width == 1:
            builder.store(vals[0], _global_ptr(builder, a, elem), align=_bits(elem) // 8)
            return context.get_dummy_value()
        vty = ir.VectorType(elem, width)
        vec = ir.Constant(vty, ir.Undefined)
        for i, v in enumerate(vals):
            vec = builder.insert_element(vec, v, ir.Constant(_I32, i))
        builder.store(vec, _global_ptr(builder, a, vty), align=width * _bits(elem) // 8)
        return context.get_dummy_value()

    return codegen


def _store(elem: ir.Type, numba_elem: Any, width: int) -> Any:
    """Store of `width` elements at an aligned global address (explicit arity: Numba's
    lowering does not accept star-args in intrinsics)."""
    codegen = _store_codegen(elem, numba_elem, width)
    if width == 1:
        @intrinsic
        def store1(typingctx: Any, addr: Any, a: Any) -> Any:
            return types.void(addr, a), codegen

        return store1
    if width == 2:
        @intrinsic
        def store2(typingctx: Any, addr: Any, a: Any, b: Any) -> Any:
            return types.void(addr, a, b), codegen

        return store2

    @intrinsic
    def store4(typingctx: Any, addr: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
        return types.void(addr, a, b, c, d), codegen

    return store4


st_v4 = _store(_I32, types.uint32, 4)
st_v2 = _store(_I32, types.uint32, 2)
st_u32 = _store(_I32, types.uint32, 1)
st_f32 = _store(_F32, types.float32, 1)
st_f32x4 = _store(_F32, types.float32, 4)


# --------------------------------------------------------------------------------------------
# Shared memory: asynchronous copies in, matrix loads out
# --------------------------------------------------------------------------------------------

@intrinsic
def smem_addr(typingctx: Any, array: Any) -> Any:
    """The 32-bit shared-memory address of a `cuda.shared.array`'s first element."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
        return builder.ptrtoint(shared, _I32)

    return types.uint32(array), codegen


def _cp_async(nbytes: int) -> Any:
    # .cg (L2 only, the stream is read once) needs 16 bytes; smaller copies go through .ca.
    level = "cg" if nbytes == 16 else "ca"
    text = f"cp.async.{level}.shared.global [$0], [$1], {nbytes};"

    @intrinsic
    def cp_async(typingctx: Any, dst: Any, src: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            d = context.cast(builder, args[0], sig.args[0], types.uint32)
            a = context.cast(builder, args[1], sig.args[1], types.int64)
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I64])
            builder.call(ir.InlineAsm(fnty, text, "r,l,~{memory}", side_effect=True), [d, a])
            return context.get_dummy_value()

        return types.void(dst, src), codegen

    return cp_async


cp_async16 = _cp_async(16)
cp_async8 = _cp_async(8)
cp_async4 = _cp_async(4)


def _cp_async_fill(nbytes: int) -> Any:
    """cp.async with a source size: copies `src_bytes` (0 or nbytes) and zero-fills the rest,
    so a row past the end of a range lands as zeros without being read."""
    level = "cg" if nbytes == 16 else "ca"
    text = f"cp.async.{level}.shared.global [$0], [$1], {nbytes}, $2;"

    @intrinsic
    def cp_async_fill(typingctx: Any, dst: Any, src: Any, src_bytes: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            d = context.cast(builder, args[0], sig.args[0], types.uint32)
            a = context.cast(builder, args[1], sig.args[1], types.int64)
            n = context.cast(builder, args[2], sig.args[2], types.uint32)
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32])
            builder.call(ir.InlineAsm(fnty, text, "r,l,r,~{memory}", side_effect=True), [d, a, n])
            return context.get_dummy_value()

        return types.void(dst, src, src_bytes), codegen

    return cp_async_fill


cp_async16_fill = _cp_async_fill(16)
cp_async8_fill = _cp_async_fill(8)
cp_async4_fill = _cp_async_fill(4)


def _volatile(text: str) -> Any:
    @intrinsic
    def op(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    return op


cp_async_commit = _volatile("cp.async.commit_group;")
cp_async_wait1 = _volatile("cp.async.wait_group 1;")  # all but the newest group landed
cp_async_wait0 = _volatile("cp.async.wait_group 0;")


@cuda.jit(device=True, forceinline=True)
def syncwarp() -> None:
    cuda.syncwarp(_FULL_MASK)


def _ldmatrix(trans: bool) -> Any:
    suffix = ".trans" if trans else ""
    text = f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0,$1,$2,$3}}, [$4];"
    ret = types.UniTuple(types.uint32, 4)

    @intrinsic
    def ldmatrix(typingctx: Any, addr: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            a = context.cast(builder, args[0], sig.args[0], types.uint32)
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
            asm = ir.InlineAsm(fnty, text, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            return _struct_to_tuple(context, builder, ret, builder.call(asm, [a]), 4)

        return ret(addr), codegen

    return ldmatrix


def _lds(width: int) -> Any:
    """ld.shared of `width` 32-bit words at a 4*width-aligned shared address."""
    ret_type = types.UniTuple(types.uint32, width) if width > 1 else types.uint32
    outs = ",".join(f"${i}" for i in range(width))
    vec = {4: ".v4", 2: ".v2", 1: ""}[width]
    text = (f"ld.shared{vec}.u32 {{{outs}}}, [${width}];" if width > 1
            else "ld.shared.u32 $0, [$1];")
    constraints = ",".join(["=r"] * width) + ",r,~{memory}"

    @intrinsic
    def lds(typingctx: Any, addr: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
            a = context.cast(builder, args[0], sig.args[0], types.uint32)
            rty = ir.LiteralStructType([_I32] * width) if width > 1 else _I32
            fnty = ir.FunctionType(rty, [_I32])
            value = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), [a])
            return _struct_to_tuple(context, builder, sig.return_type, value, width) if width > 1 \
                else value

        return ret_type(addr), codegen

    return lds


lds_v4 = _lds(4)
lds_v2 = _lds(2)
lds_u32 = _lds(1)


# Four 8x8 16-bit matrices; lanes 8i..8i+7 give matrix i's row addresses; lane (g, c) gets
# row g, columns 2c, 2c+1 of each (trans: rows 2c, 2c+1 of column g).
ldmatrix_x4 = _ldmatrix(False)
ldmatrix_x4_trans = _ldmatrix(True)


# --------------------------------------------------------------------------------------------
# Tensor cores
# --------------------------------------------------------------------------------------------

def _mma(shape: str, kind: str, num_a: int, num_b: int) -> Any:
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
        out = _asm(builder, ir.LiteralStructType([_F32] * 4), vals, text, constraints)
        return _struct_to_tuple(context, builder, ret, out, 4)

    if num_a == 4:
        @intrinsic
        def mma_k16(typingctx: Any, a0: Any, a1: Any, a2: Any, a3: Any, b0: Any, b1: Any,
                    c0: Any, c1: Any, c2: Any, c3: Any) -> Any:
            return ret(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

        return mma_k16

    @intrinsic
    def mma_k8(typingctx: Any, a0: Any, a1: Any, b0: Any, c0: Any, c1: Any, c2: Any,
               c3: Any) -> Any:
        return ret(a0, a1, b0, c0, c1, c2, c3), codegen

    return mma_k8


mma16816_f16 = _mma("m16n8k16", "f16", 4, 2)
mma16816_bf16 = _mma("m16n8k16", "bf16", 4, 2)
mma1688_f16 = _mma("m16n8k8", "f16", 2, 1)
mma1688_bf16 = _mma("m16n8k8", "bf16", 2, 1)


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


@intrinsic
def movmatrix(typingctx: Any, word: Any) -> Any:
    """Transpose an 8x8 matrix of 16-bit elements held one row-pair per lane: lane (g, c)
    holds row g, columns 2c and 2c+1, before and after (`movmatrix.sync.aligned.m8n8.trans`)."""
    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        w = context.cast(builder, args[0], sig.args[0], types.uint32)
        return _asm(builder, _I32, [w], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")

    return types.uint32(word), codegen
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


@intrinsic
def f32_bits(typingctx: Any, x: Any) -> Any:
    """The bit pattern of a float32 as uint32 (shuffles and packed stores move words)."""
    def codegen(context: Any, builder: Any, sig: Any, args: list[Any]) -> Any:
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), _I32)

    return types.uint32(x), codegen


# --------------------------------------------------------------------------------------------
# Warp shuffles (every lane of the warp takes part: the kernels call them warp-uniformly)
# --------------------------------------------------------------------------------------------

@cuda.jit(device=True, forceinline=True)
def shfl_xor(value: Any, lane_mask: Any) -> Any:
    return cuda.shfl_xor_sync(_FULL_MASK, value, lane_mask)


@cuda.jit(device=True, forceinline=True)
def shfl_idx(value: Any, src_lane: Any) -> Any:
    return cuda.shfl_sync(_FULL_MASK, value, src_lane)
