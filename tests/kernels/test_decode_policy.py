"""The split-K decode policy (issue 43 item 2), on the host: no GPU, no simulator.

Figures use an H100/H200 (sm_90, 132 SMs): the one-pass kernel holds 6 blocks per SM (792),
the split-K kernel 5 (660) — the static gate's register counts (`bench/kernel_sass.py`).
The first tests are the static check that each kernel's occupancy comes from that kernel.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

if importlib.util.find_spec("numba_cuda") is None:   # [dev] installs Numba CUDA on Linux only
    pytest.skip("needs numba-cuda (its CUDA bindings ship Linux wheels only)", allow_module_level=True)

from kernels._validate import KernelInputError  # noqa: E402
from kernels.cuda import decode, decode_split, plan  # noqa: E402
from kernels.cuda._host import spec_for  # noqa: E402
from kernels.cuda.decode_policy import (  # noqa: E402
    MAX_PARTS,
    MIN_SPLIT_TOKENS,
    Occupancy,
    graph_items,
    part_tokens,
    split_parts,
    uniform_parts,
    wave_efficiency,
    work_items,
)

SMS = 132
H200 = Occupancy(one_pass=6 * SMS, split=5 * SMS)
HEADS_GRID = 8  # 8 KV heads, GQA 4: one block per (partition, KV head)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class FakeKernel:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def distinct_occupancy(monkeypatch):
    """Each kernel object reports its own resident blocks: the one-pass kernel 792, the
    split-K kernel 660 (an H200's), nothing compiled."""
    one_pass, split = FakeKernel("one-pass"), FakeKernel("split")
    monkeypatch.setattr(decode, "decode_kernel", lambda spec: one_pass)
    monkeypatch.setattr(decode_split, "split_kernel", lambda spec: split)
    by_kernel = {id(one_pass): (decode.DECODE_SIGNATURE, H200.one_pass),
                 id(split): (decode_split.SPLIT_SIGNATURE, H200.split)}

    def resident(kernel, signature, threads):
        expected_signature, blocks = by_kernel[id(kernel)]
        assert signature == expected_signature and threads == 128
        return blocks

    monkeypatch.setattr(decode, "kernel_resident_blocks", resident)
    decode.resident_blocks.cache_clear()
    yield
    decode.resident_blocks.cache_clear()


def test_each_kernels_occupancy_comes_from_that_kernel(distinct_occupancy) -> None:
    spec = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "decode")
    assert decode.resident_blocks(spec) == H200


def test_dispatch_judges_split_grids_by_the_split_kernel(distinct_occupancy) -> None:
    """B=16 x 32768 (the review's cell at 0.62 of copy): 5 partitions fill the split kernel's
    660 slots in one wave; had the dispatch used the one-pass kernel's 792 it would pick 6
    (768 blocks: 1.16 waves). Checked on both entry points: the direct call and a plan."""
    spec = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "decode")
    tables = np.zeros((16, 2048), np.int32)
    lens = np.full(16, 32768, np.int32)
    parts = decode_split.parts_for(spec, 16, tables, lens, None, decode.resident_blocks(spec))
    assert parts is not None and parts.tolist() == [5] * 16
    assert uniform_parts(16, 32768, HEADS_GRID, Occupancy(792, 792)) == 6  # the old mistake
    kc = torch.zeros((1, 8, 16, 128), dtype=torch.float16)
    the_plan = plan.DecodePlan(kc, 32, 16, 2048)
    assert the_plan.occupancy == H200 and the_plan.num_parts == 5 and the_plan.split


def _blocks(batch: int, ctx: int, occ: Occupancy = H200) -> tuple[int, int]:
    parts = uniform_parts(batch, ctx, HEADS_GRID, occ)
    return parts, batch * parts * HEADS_GRID


def test_no_split_grid_overfills_the_split_kernel() -> None:
    """Every graph bucket at every context: a split grid either fits one wave of the split
    kernel or is >= 85% efficient over its waves (never the old 1.16-1.19 waves)."""
    for batch in BUCKETS:
        for ctx in (1024, 4096, 8192, 32768, 131072, 1 << 20):
            parts, blocks = _blocks(batch, ctx)
            if parts > 1:
                assert blocks <= H200.split or wave_efficiency(blocks, H200.split) >= 0.85, \
                    (batch, ctx, parts, blocks)


@pytest.mark.parametrize(("batch", "ctx", "parts"), [
    (1, 512, 1), (16, 512, 1), (64, 512, 1),      # short contexts never split (was x2)
    (1, 4096, 16),                                 # 256-token partitions: 128 blocks
    (1, 32768, 57),                                # 456 blocks: within 85% of the best
    (2, 32768, 35), (4, 32768, 18), (8, 32768, 9),  # 560-576 blocks (were 768-784)
    (16, 4096, 5), (16, 32768, 5),                  # 640 blocks: one wave (was 6: 768)
    (32, 32768, 5),                                 # 1280 blocks: 1.94 waves (was 3: 768)
    (48, 32768, 3),                                 # 1152: 1.75 waves (was 2: 768)
    (64, 32768, 1), (256, 32768, 1),                # the one-pass grid fills the GPU
])
def test_uniform_partition_counts_on_an_h200(batch: int, ctx: int, parts: int) -> None:
    assert _blocks(batch, ctx)[0] == parts


def test_ragged_batch_gets_a_common_chunk() -> None:
    """One 32K sequence beside fifteen 1K ones: the long one gets many partitions, the short
    ones few; every block carries about one chunk, all in one wave of the split kernel.
    Partitioning by a common count (each sequence in as many parts) leaves the 32K sequence's
    parts 32x longer than the others' and sets the time."""
    lens = np.array([32768] + [1024] * 15)
    parts = split_parts(lens, HEADS_GRID, H200)
    assert parts is not None
    per = part_tokens(lens, parts)
    assert parts[0] > 16 * parts[1:].max()
    assert int(parts.sum()) * HEADS_GRID <= H200.split
    assert per.max() <= 1024 and per[0] <= 2 * per[1:].min()
    common = uniform_parts(16, 32768, HEADS_GRID, H200)
    assert -(-32768 // common) > 5 * per.max()  # what a common count would give the long one


def test_short_sequences_are_never_split() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        lens = rng.integers(1, 40_000, int(rng.integers(1, 300)))
        parts = split_parts(lens, HEADS_GRID, H200)
        if parts is not None:
            assert (parts[lens < MIN_SPLIT_TOKENS] == 1).all()


def test_random_partitions_are_consistent() -> None:
    """Random ragged batches: partitions cover each sequence, at most MAX_PARTS per sequence,
    a bound on work items is kept, padded rows (length 0) get none."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(1, 64))
        lens = rng.integers(0, 1 << int(rng.integers(8, 21)), n)
        max_items = int(rng.integers(n, 8 * n)) if trial % 2 else None
        parts = split_parts(lens, HEADS_GRID, H200, max_items)
        if parts is None:
            continue
        assert parts.shape == lens.shape and (parts <= MAX_PARTS).all()
        assert ((parts == 0) == (lens == 0)).all()
        assert (part_tokens(lens, parts) * parts >= lens).all()
        if max_items is not None:
            assert int(parts.sum()) <= max_items


def test_graph_items_cover_the_design_point_and_a_wave() -> None:
    for batch in BUCKETS:
        items = graph_items(batch, 32768, HEADS_GRID, H200)
        design = batch * uniform_parts(batch, 32768, HEADS_GRID, H200)
        assert design <= items <= batch * MAX_PARTS
        assert items >= min(batch * MAX_PARTS, batch + math.ceil(H200.split / HEADS_GRID))
        # a ragged step of this bucket, partitioned within the bucket's items
        lens = np.array([32768] + [1024] * (batch - 1))
        parts = split_parts(lens, HEADS_GRID, H200, items)
        assert parts is None or int(parts.sum()) <= items


def test_work_items_layout() -> None:
    work = work_items(np.array([3, 0, 2], np.int32), max_items=7)
    assert work[:7].tolist() == [0, 0, 0, 2, 2, -1, -1]  # the sequence of each item
    assert work[7:].tolist() == [0, 3, 3, 5]  # each sequence's first item, and the total
    with pytest.raises(ValueError, match="exceed"):
        work_items(np.array([4, 4], np.int32), max_items=7)


def test_forced_split_and_device_lengths(distinct_occupancy) -> None:
    spec = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "decode")
    occ = decode.resident_blocks(spec)
    tables = np.zeros((2, 64), np.int32)  # capacity 1024 tokens
    lens = np.array([300, 2000], np.int32)
    forced = decode_split.parts_for(spec, 2, tables, lens, True, None)
    assert forced is not None and forced.tolist() == [5, 32]  # 64-token partitions
    assert decode_split.parts_for(spec, 2, tables, lens, False, None) is None

    class DeviceLens:  # device-resident lengths are never read back: capacity for all
        shape, dtype = (2,), np.dtype(np.int32)

        @property
        def __cuda_array_interface__(self) -> dict[str, tuple[int, ...]]:
            return {"shape": (2,)}

    on_device = decode_split.parts_for(spec, 2, tables, DeviceLens(), None, occ)
    assert on_device is not None and len(set(on_device.tolist())) == 1
    with pytest.raises(KernelInputError, match="occupancy"):
        decode_split.parts_for(spec, 2, tables, lens, None, None)
