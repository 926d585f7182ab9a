"""The simulator's thread-block runner as replaced in `conftest.py` keeps CUDA's barrier rules.

`__syncthreads` waits for the block's threads that have not exited; a thread that raises
makes the launch raise that error (not hang, not an "abort" error of a bystander).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda


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
