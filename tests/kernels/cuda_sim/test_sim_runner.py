"""The simulator's thread-block runner (`coop_runner.py`) keeps CUDA's barrier rules.

`__syncthreads` waits for the block's threads that have not exited; a thread that raises
makes the launch raise that error (not hang, not an "abort" error of a bystander); barriers
that can never complete fail the launch at once. A missing barrier is caught whichever warp
writes: each block starts with shared memory of its own full of NaN, and blocks alternate
which end of the block runs ahead.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32

from kernels.cuda import _ops_sim as ops


def test_a_thread_that_raises_fails_the_launch_with_its_error() -> None:
    @cuda.jit
    def kernel(out):
        i = cuda.threadIdx.x
        cuda.syncthreads()
        if i == 5:
            raise ValueError("thread 5 failed")
        cuda.syncthreads()
        out[i] = 1

    out = np.zeros(64, np.int32)
    with pytest.raises(ValueError, match="thread 5 failed"):
        kernel[2, 64](out)


def test_exited_threads_do_not_hold_the_barrier() -> None:
    @cuda.jit
    def kernel(out):
        i = cuda.threadIdx.x
        if i >= 40:
            return
        out[i] = i
        cuda.syncthreads()
        right = out[(i + 1) % 40]
        cuda.syncthreads()
        out[i] += right

    out = np.zeros(64, np.int64)
    kernel[3, 64](out)
    want = np.zeros(64, np.int64)
    want[:40] = np.arange(40) + (np.arange(1, 41) % 40)
    assert (out == want).all()


def test_a_collective_not_every_lane_reaches_fails_at_once() -> None:
    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        if lane < 16:
            out[lane] = ops.shfl_xor(lane, 1)   # half a warp: the other lanes never arrive

    with pytest.raises(RuntimeError, match="deadlock"):
        kernel[1, 32](np.zeros(32, np.int64))


@pytest.mark.parametrize("barrier", [True, False])
def test_a_missing_barrier_reads_poison_whichever_warp_writes(barrier: bool) -> None:
    @cuda.jit
    def kernel(out, barrier):
        tid = cuda.threadIdx.x
        sh = cuda.shared.array(64, float32)
        sh[tid] = tid
        if barrier:
            cuda.syncthreads()
        out[cuda.blockIdx.x, tid] = sh[(tid + 32) % 64]   # the other warp's element

    out = np.zeros((2, 64), np.float32)
    kernel[2, 64](out, barrier)
    want = (np.arange(64) + 32) % 64
    if barrier:
        assert (out == want).all()
    else:   # block 0 runs warp 0 first, block 1 warp 1: each reads before the writer ran
        assert np.isnan(out[0, :32]).all() and (out[0, 32:] == want[32:]).all()
        assert np.isnan(out[1, 32:]).all() and (out[1, :32] == want[:32]).all()


def test_each_block_starts_with_its_own_shared_memory() -> None:
    @cuda.jit
    def kernel(out):
        tid = cuda.threadIdx.x
        sh = cuda.shared.array(32, float32)
        out[cuda.blockIdx.x, tid] = sh[tid]   # before any write of this block
        sh[tid] = 1.0

    out = np.zeros((3, 32), np.float32)
    kernel[3, 32](out)
    assert np.isnan(out).all()
