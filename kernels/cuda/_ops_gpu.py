"""Memory operations of the kernels as Numba CUDA intrinsics (GPU only; math: `_ops_gpu_math`).

Numba has no vector loads, asynchronous copies or matrix loads, and its array indexing costs
64-bit index arithmetic with wraparound checks per element. These intrinsics emit the PTX
directly, so a kernel addresses memory as one 64-bit base plus small offsets (ptxas folds
constant offsets into the instruction) and moves 16 bytes per instruction:

- global memory: addresses are plain int64 (`tensor.data_ptr()`, passed by the host wrapper);
  `ld_*` are read-only loads (queries, tables, lengths, split-K partials: invariant for the
  kernel's lifetime, so `ld.global.nc`), `st_*` plain stores;
- shared memory: `smem_addr` (a shared array's 32-bit address), `cp.async` 16/8/4-byte copies
  global → shared that bypass registers (with a zero-filling variant for rows past a range),
  their commit / wait groups, `ldmatrix` (.trans) fragment loads and `ld.shared` vectors.

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


def _collective_asm(builder: Any, ret: ir.Type, args: list[Any], text: str,
                    constraints: str) -> Any:
    """Inline asm of a warp-collective instruction (`mma.sync`, `movmatrix`, `ldmatrix`).

    Why `sideeffect` + `convergent`: every lane of the warp must execute the instruction
    together. A pure asm call may be sunk into a branch, hoisted out of one, duplicated into
    both arms (tail duplication, unswitching) or deleted when its result looks unused; each of
    these can leave some lanes without it (undefined behaviour or a hang on the GPU). The
    markings forbid exactly these transformations, the same way NVVM treats its own
    `shfl.sync` / `bar.warp.sync` intrinsics."""
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args,
                        attrs=("convergent",))


# --------------------------------------------------------------------------------------------
# Loads and stores
# --------------------------------------------------------------------------------------------

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


@cuda.jit(device=True, forceinline=True)
def any_sync(predicate: Any) -> Any:
    """Whether `predicate` holds in any lane of the (converged) warp: `vote.sync.any`."""
    return cuda.any_sync(_FULL_MASK, predicate) != 0


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
            out = builder.call(asm, [a], attrs=("convergent",))  # collective: see _collective_asm
            return _struct_to_tuple(context, builder, ret, out, 4)

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
