"""Host-side logic of the CUDA backend that needs no GPU and no simulator.

Wave planning for copy_blocks, the split-K dispatch rule, variant specs and the
no-GPU behaviour of argument conversion.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels._validate import KernelInputError
from kernels.cuda._runtime import SIMULATOR, to_kernel_array
from kernels.cuda._spec import MAX_SHARED_BYTES, AttentionSpec, prefill_query_tile, threads_for
from kernels.cuda.block_copy import plan_waves
from kernels.cuda.decode import choose_num_partitions, partition_size


def _apply_waves(blocks: np.ndarray, ordered: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """What the kernel does: within a wave all pairs read, then all write (worst-case race)."""
    for begin, end in bounds:
        reads = [blocks[src].copy() for src, _ in ordered[begin:end]]
        for (_, dst), data in zip(ordered[begin:end], reads):
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
    sms = 132
    # short contexts never split
    assert choose_num_partitions(1, 8, 512, 16, sms) == 1
    # few sequences, long context: one partition per 512 tokens
    assert choose_num_partitions(1, 8, 32768, 16, sms) == 64
    assert choose_num_partitions(16, 8, 4096, 16, sms) == 8
    # a grid that already has >= 4 blocks per SM stays one-pass
    assert choose_num_partitions(128, 8, 32768, 16, sms) == 1
    assert partition_size(16) == 512 and partition_size(48) == 528 and partition_size(1024) == 1024


def test_spec_tiles_fit_shared_memory() -> None:
    for head_dim in (64, 128, 256):
        for block_size in (8, 16, 32, 64, 128):
            for group in (1, 4, 8):
                spec = AttentionSpec(head_dim, block_size, group, "f16", "f16", "f16", 128,
                                     query_tile=prefill_query_tile(group))
                spec.check()
                assert block_size % spec.tile_tokens == 0
                assert spec._shared_bytes(spec.tile_tokens) <= MAX_SHARED_BYTES


def test_spec_rejects_unrunnable_variants() -> None:
    with pytest.raises(KernelInputError, match="shared-memory"):
        AttentionSpec(1024, 16, 32, "f16", "f16", "f16", 1024).check()
    with pytest.raises(KernelInputError, match="num_threads"):
        AttentionSpec(64, 16, 1, "f16", "f16", "f16", 100).check()
    with pytest.raises(KernelInputError, match="query rows"):
        AttentionSpec(64, 16, 64, "f16", "f16", "f16", 32).check()


@pytest.mark.skipif(SIMULATOR, reason="host arrays are valid kernel arguments in the simulator")
def test_host_arrays_rejected_without_a_gpu_path() -> None:
    with pytest.raises(KernelInputError, match="device data"):
        to_kernel_array(np.zeros(4, dtype=np.float32))


def test_threads_scale_with_accumulators() -> None:
    assert threads_for(4, 128, 128) == 128  # GQA-4 decode
    assert threads_for(8, 128, 128) == 128  # GQA-8 decode: 8 accumulators per thread
    assert threads_for(16, 128, 128) == 256  # prefill tile of 16 rows
    assert threads_for(32, 256, 128) == 1024  # MQA-32 with head dim 256: capped
    assert threads_for(32, 256, 1024) == 1024
