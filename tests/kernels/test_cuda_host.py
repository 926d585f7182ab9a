"""Host-side logic of the CUDA backend that needs no GPU and no simulator.

Wave planning for copy_blocks, the split-K dispatch entry points, variant specs and their launch
bounds, reused scratch, memoised launch configurations, and the no-GPU behaviour of argument
conversion.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("numba_cuda") is None:   # [dev] installs Numba CUDA on Linux only
    pytest.skip("needs numba-cuda (its CUDA bindings ship Linux wheels only)", allow_module_level=True)

import kernels  # noqa: E402
from kernels._validate import KernelInputError
from kernels.cuda import _runtime
from kernels.cuda._host import Scratch, launch_bounds, spec_for
from kernels.cuda._runtime import SIMULATOR, check_aligned, device_ptr, launcher
from kernels.cuda._spec import AttentionSpec, simt_vec
from kernels.cuda.block_copy import plan_waves
from kernels.cuda.decode_policy import MAX_PARTS, Occupancy
from kernels.cuda.decode_split import choose_num_partitions, parts_for

REPO = Path(__file__).resolve().parents[2]


def _apply_waves(blocks: np.ndarray, ordered: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """What the kernel does: within a wave all pairs read, then all write (worst-case race)."""
    for begin, end in bounds:
        reads = [blocks[src].copy() for src, _ in ordered[begin:end]]
        for (_, dst), data in zip(ordered[begin:end], reads, strict=True):
            blocks[dst] = data


def test_plan_waves_splits_dependent_pairs() -> None:
    ordered, bounds = plan_waves(np.array([[1, 2], [3, 4], [2, 5], [6, 1]], dtype=np.int64))
    # [2,5] reads block 2 written by [1,2]; [6,1] overwrites block 1 that [1,2] reads.
    assert bounds == [(0, 2), (2, 4)]
    assert ordered.tolist() == [[1, 2], [3, 4], [2, 5], [6, 1]]


def test_plan_waves_drops_noops_and_keeps_independent_pairs_together() -> None:
    ordered, bounds = plan_waves(np.array([[3, 3], [0, 7], [1, 8], [2, 9]], dtype=np.int64))
    assert bounds == [(0, 3)]
    assert ordered.tolist() == [[0, 7], [1, 8], [2, 9]]
    _, none = plan_waves(np.zeros((0, 2), dtype=np.int64))
    assert none == []


@pytest.mark.parametrize("seed", range(20))
def test_plan_waves_equals_sequential_copies(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_blocks = 6  # few blocks: many conflicts
    pairs = rng.integers(0, num_blocks, size=(int(rng.integers(1, 15)), 2)).astype(np.int64)
    blocks = rng.standard_normal((num_blocks, 3))
    expected = blocks.copy()
    for src, dst in pairs:
        expected[dst] = expected[src].copy()
    ordered, bounds = plan_waves(pairs)
    _apply_waves(blocks, ordered, bounds)
    np.testing.assert_array_equal(blocks, expected)


def test_split_dispatch_rule() -> None:
    """`choose_num_partitions` (uniform batches; the policy itself is
    tests/kernels/test_decode_policy.py's): each kernel's own resident blocks."""
    occupancy = Occupancy(one_pass=132 * 6, split=132 * 5)  # an H200
    # B=64 x 8 KV heads = 512 blocks: most of the GPU already, one pass
    assert choose_num_partitions(512, 4096, occupancy) == 1
    # B=16: 128 blocks -> 5 partitions fill the split kernel's 660 slots in one wave
    assert choose_num_partitions(128, 4096, occupancy) == 5
    assert choose_num_partitions(128, 1200, occupancy) == 5  # 256-token partitions
    # one sequence, long context: up to MAX_PARTS, the fewest within 85% of the best
    assert 48 <= choose_num_partitions(8, 32768, occupancy) <= MAX_PARTS
    # short contexts never split
    assert choose_num_partitions(8, 1000, occupancy) == 1


def test_partitions_follow_host_lengths_else_capacity() -> None:
    spec = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "decode")
    occupancy = Occupancy(660, 660)
    tables = np.zeros((1, 2048), np.int32)  # capacity 32768 tokens
    short = np.array([300], np.int32)
    assert parts_for(spec, 1, tables, short, None, occupancy) is None  # sized by seq_lens
    assert parts_for(spec, 1, tables, short, False, occupancy) is None
    forced = parts_for(spec, 1, tables, short, True, occupancy)  # forced: 64-token parts
    assert forced is not None and forced.tolist() == [5]

    class DeviceLens:  # device-resident lengths are never read back
        shape, dtype = (1,), np.dtype(np.int32)

        @property
        def __cuda_array_interface__(self) -> dict[str, tuple[int, ...]]:
            return {"shape": (1,)}

    capacity = parts_for(spec, 1, tables, DeviceLens(), None, occupancy)
    assert capacity is not None and 48 <= int(capacity[0]) <= MAX_PARTS


def test_spec_paths_rows_and_warps() -> None:
    bench = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "decode")
    assert (bench.path, bench.rows, bench.row_tiles, bench.row_blocks) == ("tc", 4, 1, 1)
    assert bench.num_threads == 128 and launch_bounds(bench) == (128, 6)  # <= 80 registers
    split = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "split")
    assert launch_bounds(split) == (128, 5)  # <= 96: at 80 the split-K kernel spills
    wide = spec_for(256, 16, 1, 32, "bf16", "bf16", "bf16", "decode")
    assert (wide.num_warps, wide.rows, wide.row_blocks) == (2, 8, 4)
    prefill = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "prefill")
    assert (prefill.rows, prefill.row_tiles) == (16, 2) and launch_bounds(prefill) == (128, 1)
    assert spec_for(128, 16, 8, 4, "f32", "f32", "f32", "decode").path == "simt"
    assert spec_for(128, 16, 8, 4, "f32", "f16", "f16", "decode").path == "simt"  # mixed
    assert spec_for(80, 16, 8, 4, "f16", "f16", "f16", "decode").path == "tc"
    odd = spec_for(12, 16, 8, 4, "f16", "f16", "f16", "decode")
    assert odd.path == "simt" and simt_vec(12, "f16") == 2
    f32 = spec_for(256, 16, 8, 4, "f32", "f32", "f32", "prefill")
    assert f32.rows == 4 and f32.num_warps == 2  # 8 floats per lane; staging under 40 KB


def test_spec_rejects_unrunnable_variants() -> None:
    with pytest.raises(KernelInputError, match="head_dim"):
        AttentionSpec(512, 16, 1, 4, "f16", "f16", "f16").check()
    with pytest.raises(KernelInputError, match="head_dim"):
        AttentionSpec(30, 16, 1, 4, "f16", "f16", "f16").check()
    with pytest.raises(KernelInputError, match="mode"):
        AttentionSpec(64, 16, 1, 4, "f16", "f16", "f16", "train").check()


def test_scratch_grows_and_is_reused() -> None:
    scratch = Scratch()
    like = torch.zeros(4)
    first = scratch.get(like, 100)
    assert first.shape[0] >= 100 and scratch.get(like, 50) is first
    bigger = scratch.get(like, 300)
    assert bigger.shape[0] >= 300 and bigger is not first
    assert scratch.get(like, 200) is bigger


def test_launch_configurations_are_memoised(monkeypatch) -> None:
    monkeypatch.setattr(_runtime, "_launch_cache", {})
    built = []

    class Kernel:
        def __getitem__(self, config):
            built.append(config)
            return lambda *args: args

    kernel = Kernel()
    first = launcher(kernel, (8, 2), 128, 0)
    assert launcher(kernel, (8, 2), 128, 0) is first
    launcher(kernel, (8, 3), 128, 0)
    assert built == [((8, 2), 128, 0), ((8, 3), 128, 0)]


@pytest.mark.skipif(SIMULATOR, reason="host arrays are valid kernel arguments in the simulator")
def test_host_arrays_rejected_without_a_gpu_path() -> None:
    with pytest.raises(KernelInputError, match="device data"):
        device_ptr(np.zeros(4, dtype=np.float32))
    with pytest.raises(KernelInputError, match="CUDA tensors"):
        device_ptr(torch.zeros(4))
    with pytest.raises(KernelInputError, match="aligned"):
        check_aligned("out", 8)
    check_aligned("out", 256)


def test_graph_entry_points_are_imported_lazily() -> None:
    code = ("import sys, kernels; assert 'kernels.cuda' not in sys.modules; "
            "from kernels.cuda.graph import DecodeGraphs; from kernels.cuda.plan import DecodePlan; "
            "assert kernels.DecodeGraphs is DecodeGraphs and kernels.DecodePlan is DecodePlan")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    with pytest.raises(AttributeError):
        _ = kernels.NoSuchThing
