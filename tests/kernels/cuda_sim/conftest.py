"""Simulator-only tests: collected only when NUMBA_ENABLE_CUDASIM=1 was set before numba loaded.

The main pytest process runs without the simulator (the CPU kernels need real Numba), so it
skips this folder; `tests/kernels/test_cuda_simulator.py` runs it in a subprocess with the
variable set.

Two test-only changes to the simulator (the kernels are unchanged):

- a fix: its `cuda.shared.array` looks an allocation up by call site and creates it if
  missing without a lock, so two simulated threads of one block can each create their own
  copy of "the" shared array (a check-then-set race that real GPUs do not have). We install
  the same lookup under a lock.
- speed: its thread-block runner polls its threads in a busy loop (is each one blocked in
  `syncthreads`? alive?) for as long as the block runs, so the launching thread competes for
  the GIL with the 64-128 simulated threads doing the work, and every `syncthreads` waits for
  that loop to come round. `_run_block` keeps the same semantics (a barrier of the block's
  live threads; a thread's exception aborts the others at their next barrier and is raised
  by the launch) with a condition variable: the last thread to arrive releases the others,
  and the launching thread sleeps in `join`.

With the simulator twins of the warp collectives in `kernels/cuda/_ops_sim.py` (one barrier
per collective, the mma fragments decoded with array operations) the simulator folder went
from 183 to ~60 CPU-s serially (BENCHMARKS.md, "Test-suite cost, round 4"); with each warp's
`mma`/`ldmatrix` matrices built once instead of by all 32 lanes, and a gate per lane in the
warp barrier, to ~35 (0.64x side by side, round 11).
"""

import os
import sys
import threading

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if not SIMULATOR:
    collect_ignore_glob = ["test_*.py"]
else:
    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    # Python's default switch interval (5 ms) is kept: with the runner below the simulated
    # threads block on barriers instead of being polled, and a shorter interval only adds
    # switches (5e-4 s: 33-34 CPU-s for test_sim_attention.py, 5 ms: 25-27, side by side).
    _shared_lock = threading.Lock()
    _unlocked_array = kernelapi.FakeCUDAShared.array

    def _locked_shared_array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return _unlocked_array(self, shape, dtype, alignment)  # not used by our kernels
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)  # the kernel line that declares the array
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with _shared_lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    kernelapi.FakeCUDAShared.array = _locked_shared_array

    class _BlockSync:
        """The block-wide barrier of one thread block's live threads (CUDA: `__syncthreads`
        counts the threads that have not exited)."""

        def __init__(self, num_threads: int) -> None:
            self.cond = threading.Condition()
            self.live = num_threads
            self.waiting = 0
            self.generation = 0
            self.abort = False

        def release_if_complete(self) -> None:   # under self.cond
            if self.waiting and self.waiting == self.live:
                self.waiting = 0
                self.generation += 1
                self.cond.notify_all()

    def _syncthreads(self) -> None:
        sync = self._manager._pagedkv_sync
        with sync.cond:
            if sync.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            generation = sync.generation
            sync.waiting += 1
            sync.release_if_complete()
            while sync.generation == generation and not sync.abort:
                sync.cond.wait()
            if sync.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    _thread_run = sim_kernel.BlockThread.run

    def _thread_run_then_leave(self) -> None:
        try:
            _thread_run(self)       # records an exception in self.exception
        finally:
            sync = self._manager._pagedkv_sync
            with sync.cond:
                sync.live -= 1
                if self.exception is not None:
                    sync.abort = True
                    sync.cond.notify_all()
                else:
                    sync.release_if_complete()

    def _run_block(self, grid_point, *args) -> None:
        threads = [sim_kernel.BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
                   for block_point in np.ndindex(*self._block_dim)]
        self._pagedkv_sync = _BlockSync(len(threads))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [t for t in threads if t.exception is not None]
        # the first failure, not an aborted bystander's "abort flag set" error
        first = next((t for t in failed if "abort flag set" not in str(t.exception[0])), failed[0] if failed else None)
        if first is not None:
            raise first.exception[0].with_traceback(first.exception[1])

    sim_kernel.BlockThread.syncthreads = _syncthreads
    sim_kernel.BlockThread.run = _thread_run_then_leave
    sim_kernel.BlockManager.run = _run_block
