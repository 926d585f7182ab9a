"""Compile CUDA kernel variants to PTX for sm_90 (H100/H200) — no GPU, no ptxas needed.

The simulator runs kernels as Python and checks no types, so typing errors that only a real
GPU build hits (float64 promotion, unsupported casts, local arrays indexed at run time) would
slip through it. This builds the PTX the GPU would JIT — with the same launch bounds — for a
covering set of the variants the dispatcher produces: every value of each axis (fp16 / bf16 /
fp32, head dim 64 / 128 / 256 / odd, block size 8 / 16 / 4, GQA 1 / 4 / 8 / 16, decode /
split-K / reduce / prefill / write / copy, tensor-core and SIMT paths) appears at least once.
The cross product runs with --slow. The machine-code budgets (registers, spills, load widths)
are `test_kernel_sass.py`'s.
"""

from __future__ import annotations

import itertools
import re
import sys

import pytest

if sys.platform != "linux":   # pyproject's [dev] installs NVVM / NVRTC (Linux-only wheels) on Linux alone
    pytest.skip("compiling PTX needs NVVM and NVRTC, installed by [dev] on Linux only", allow_module_level=True)

from bench_modules import load_bench  # noqa: E402

from kernels.cuda import block_copy, decode_reduce, slot_write  # noqa: E402


def _kernel_sass():
    return load_bench("kernel_sass")


KS = _kernel_sass()


def _ptx(variant) -> str:
    ptx = KS.variant_ptx(variant)   # compiled once per run: test_kernel_sass.py reuses it
    assert ".target sm_90" in ptx
    # Attention math is float32 by design: a float64 op means an accidental promotion
    # (Python float constant, wrong cast), which costs ~64x throughput on the GPU.
    f64_ops = [line for line in ptx.splitlines() if re.search(r"\.f64\b", line)]
    assert not f64_ops, f"float64 instructions in PTX: {f64_ops[:3]}"
    # Per-lane fragments and accumulators must be registers: a local array indexed at run
    # time lands in local memory (`.local`) before ptxas even allocates registers.
    assert ".local" not in ptx, "local-memory arrays in PTX"
    assert ".maxntid" in ptx, "launch bounds missing: ptxas could exceed what the launch holds"
    # No fastmath: flush-to-zero or approximate division anywhere but the deliberate ex2.
    approx = [line for line in ptx.splitlines()
              if re.search(r"\.ftz|\.approx", line) and "ex2.approx.ftz.f32" not in line]
    assert not approx, f"fast-math instructions in PTX: {approx[:3]}"
    return ptx


# The default run compiles each kernel mode once on each path (tensor cores, SIMT); the rest
# of the covering set (every value of each axis at least once: ~2 minutes of NVVM on 2 cores)
# runs with --slow, as does the cross product.
_SLOW = pytest.mark.slow
ATTENTION = [
    # (mode, dtype, head_dim, block_size, group)
    ("decode", "f16", 128, 16, 4),  # the benchmark variant
    pytest.param(("decode", "bf16", 64, 8, 8), marks=_SLOW),
    pytest.param(("decode", "f16", 256, 16, 16), marks=_SLOW),  # two warps, one row tile, two row blocks
    ("decode", "f32", 128, 16, 4),  # SIMT
    ("split", "f16", 128, 4, 1),  # a table lookup per token
    pytest.param(("split", "f32", 64, 16, 8), marks=_SLOW),
    ("prefill", "f16", 128, 16, 4),  # two row tiles
    pytest.param(("prefill", "bf16", 256, 16, 1), marks=_SLOW),
    pytest.param(("prefill", "f32", 128, 8, 4), marks=_SLOW),
]


@pytest.mark.parametrize("axes", ATTENTION, ids=lambda a: "-".join(map(str, a)))
def test_attention_variant_compiles(axes) -> None:
    mode, dtype, head_dim, block_size, group = axes
    ptx = _ptx(KS.Variant("v", mode, head_dim, block_size, group, dtype))
    if dtype != "f32":  # the tensor-core path: its machine operations are in the PTX
        for op in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg",
                   "movmatrix.sync.aligned"):
            assert op in ptx, op
    else:
        assert "cp.async" in ptx and "shfl.sync" in ptx


@pytest.mark.slow
def test_odd_head_dim_compiles() -> None:
    """head_dim 80 (not a multiple of 64): generic staging layout, tensor cores; the FA2-class
    prefill stages its shared tiles through the same layout."""
    _ptx(KS.Variant("v", "decode", 80, 16, 4, "f16"))
    ptx = _ptx(KS.Variant("v", "prefill", 80, 16, 4, "f16"))
    assert "cp.async.cg.shared.global" in ptx and "bar.sync" in ptx


@pytest.mark.parametrize("dtype", ["f16", pytest.param("bf16", marks=_SLOW), pytest.param("f32", marks=_SLOW)])
def test_reduce_write_copy_compile(dtype: str) -> None:
    for kind in ("reduce", "write", "copy"):
        ptx = _ptx(KS.Variant("v", kind, 128, 16, 4, dtype))
        assert "ld.global" in ptx
    assert decode_reduce.THREADS == slot_write.THREADS == block_copy.THREADS == 128


FULL = list(itertools.product(("decode", "split", "prefill"), ("f16", "bf16", "f32"),
                              (64, 128, 256), (8, 16, 32), (1, 4, 8)))


@pytest.mark.slow
@pytest.mark.parametrize("axes", FULL, ids=lambda a: "-".join(map(str, a)))
def test_every_attention_variant_compiles(axes) -> None:
    mode, dtype, head_dim, block_size, group = axes
    _ptx(KS.Variant("v", mode, head_dim, block_size, group, dtype))


def test_warp_collective_asm_is_sideeffect_and_convergent() -> None:
    """mma.sync / movmatrix / ldmatrix reach LLVM as `asm sideeffect ... convergent`: the
    optimiser may not sink, hoist, duplicate or drop them (every lane must execute them)."""
    from numba import types
    from numba.cuda.compiler import compile_cuda

    from kernels.cuda._ops_gpu import ldmatrix_x4
    from kernels.cuda._ops_gpu_math import mma16816_bf16, mma16816_f16, movmatrix

    def uses_collectives(a, c):
        d = mma16816_f16(a, a, a, a, a, a, c, c, c, c)
        e = mma16816_bf16(a, a, a, a, a, a, c, c, c, c)
        return d[0] + e[1] + movmatrix(a) + ldmatrix_x4(a)[0]

    cres = compile_cuda(uses_collectives, types.float32, (types.uint32, types.float32), cc=(9, 0))
    calls = [line for line in cres.library.get_llvm_str().splitlines() if " asm " in line]
    for op in ("mma.sync.aligned.m16n8k16.row.col.f32.f16", "mma.sync.aligned.m16n8k16.row.col.f32.bf16",
               "movmatrix.sync", "ldmatrix.sync"):
        found = [line for line in calls if op in line]
        assert found, f"{op} not emitted"
        for line in found:
            assert "asm sideeffect" in line and line.rstrip().endswith("convergent"), line
