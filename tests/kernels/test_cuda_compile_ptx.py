"""Compile every CUDA kernel variant to PTX for sm_90 (H200) — no GPU needed.

The simulator runs kernels as Python and checks no types, so typing errors that only a real
GPU build hits (float64 promotion, unsupported casts, bad local-array sizes) would slip
through it. This builds the PTX the GPU would JIT, for a covering set of the variants the
dispatcher produces: every value of each axis (fp16/fp32/bf16, head dim 64/128, block size
16/32, GQA group 1/4/8, one-pass/split-K/reduce, prefill, write, copy) appears at least once.
The whole cross product runs with --slow.

Numba compiles device functions for "the current device"; there is none here, so the test
reports compute capability 9.0 to that lookup (only while compiling).
"""

from __future__ import annotations

import itertools
import re
import types
from collections.abc import Iterator

import pytest

from kernels.cuda import block_copy, decode, decode_reduce, decode_split, prefill, slot_write
from kernels.cuda._runtime import DEFAULT_NUM_THREADS
from kernels.cuda._spec import AttentionSpec, prefill_query_tile, threads_for

CC = (9, 0)
PARTITION = decode.partition_size(16)


@pytest.fixture(scope="module", autouse=True)
def _sm90_device() -> Iterator[None]:
    import numba.cuda.dispatcher as dispatcher

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatcher, "get_current_device",
                   lambda: types.SimpleNamespace(compute_capability=CC))
        yield


def _spec(head_dim: int, block_size: int, group: int, q: str, kv: str, out: str,
          *, prefill_tile: bool = False) -> AttentionSpec:
    query_tile = prefill_query_tile(group) if prefill_tile else 1
    threads = threads_for(group * query_tile, head_dim, DEFAULT_NUM_THREADS)  # as dispatched
    spec = AttentionSpec(head_dim, block_size, group, q, kv, out, threads, query_tile=query_tile)
    spec.check()
    return spec


def _compile(pyfunc, signature) -> str:
    from numba import cuda

    ptx, _ = cuda.compile_ptx(pyfunc, signature, cc=CC)
    assert ".target sm_90" in ptx
    # Attention math is float32 by design: a float64 op means an accidental promotion
    # (Python float constant, wrong cast), which costs ~64x throughput on the GPU.
    f64_ops = [line for line in ptx.splitlines() if re.search(r"\.f64\b", line)]
    assert not f64_ops, f"float64 instructions in PTX: {f64_ops[:3]}"
    # Per-thread tile and accumulator arrays must live in registers, not local memory.
    assert ".local" not in ptx, "local-memory arrays (spills) in PTX"
    return ptx


DECODE = [(128, 16, 4, "f16", "f16", "f16"), (64, 32, 1, "f32", "f32", "f32"),
          (128, 32, 8, "bf16", "bf16", "bf16")]
SPLIT = [(128, 16, 8, "f16", "f16", "f16"), (64, 32, 4, "f32", "f32", "f32")]
PREFILL = [(128, 16, 4, "f16", "f16", "f16"), (64, 32, 8, "f32", "f32", "f32"),
           (128, 16, 1, "f16", "bf16", "f32")]


@pytest.mark.parametrize("axes", DECODE)
def test_decode_compiles(axes) -> None:
    spec = _spec(*axes)
    _compile(decode.build_decode_kernel(spec), decode.decode_signature(spec))


@pytest.mark.parametrize("axes", SPLIT)
def test_split_decode_compiles(axes) -> None:
    spec = _spec(*axes)
    _compile(decode_split.build_split_kernel(spec, PARTITION), decode_split.split_signature(spec))


@pytest.mark.parametrize("out_kind", ["f16", "f32", "bf16"])
def test_reduce_compiles(out_kind: str) -> None:
    _compile(decode_reduce.build_reduce_kernel(128, out_kind, DEFAULT_NUM_THREADS, PARTITION),
             decode_reduce.reduce_signature(out_kind))


@pytest.mark.parametrize("axes", PREFILL)
def test_prefill_compiles(axes) -> None:
    spec = _spec(*axes, prefill_tile=True)
    _compile(prefill.build_prefill_kernel(spec), prefill.prefill_signature(spec))


@pytest.mark.parametrize("kind", ["f16", "f32", "bf16"])
def test_write_and_copy_compile(kind: str) -> None:
    _compile(slot_write.build_write_kernel(8, 16, 128), slot_write.write_signature(kind))
    _compile(block_copy.build_copy_kernel(8, 16, 128), block_copy.copy_signature(kind, 4))


FULL = list(itertools.product(("f16", "f32", "bf16"), (64, 128), (16, 32), (1, 4, 8)))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "head_dim", "block_size", "group"), FULL)
def test_every_attention_variant_compiles(kind: str, head_dim: int, block_size: int,
                                          group: int) -> None:
    spec = _spec(head_dim, block_size, group, kind, kind, kind)
    _compile(decode.build_decode_kernel(spec), decode.decode_signature(spec))
    _compile(decode_split.build_split_kernel(spec, PARTITION), decode_split.split_signature(spec))
    pspec = _spec(head_dim, block_size, group, kind, kind, kind, prefill_tile=True)
    _compile(prefill.build_prefill_kernel(pspec), prefill.prefill_signature(pspec))
