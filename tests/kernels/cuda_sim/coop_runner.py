"""Numba's CUDA simulator with each thread block's threads as greenlets instead of OS threads.

Why: the stock simulator starts one Python thread per GPU thread, and every `__syncthreads` or
warp collective then hands the GIL and a futex from thread to thread. Measured on the 2-core CI
machine, a third of the simulator folder's CPU time was system time (40,000 futex calls for
5,900 simulated threads in one file). Here a block's threads take turns on one OS thread: each
runs until it reaches a barrier or exits, then switches to the block's scheduler, which resumes
the next ready thread (a switch is a few hundred nanoseconds and no system call).

The semantics are CUDA's, as before:

- `__syncthreads` waits for the block's threads that have not exited; its last arrival makes
  them all ready again;
- a warp collective (kernels/cuda/_ops_sim.py) waits for its warp's 32 lanes; the last lane to
  arrive computes the warp-wide result and makes the others ready;
- a thread that raises fails the launch with its error (the others are discarded);
- threads that wait on barriers nobody else will reach (divergent barriers) fail the launch
  at once with a description, instead of hanging until a timeout.

Running each thread until it blocks is one legal GPU schedule. So that a missing barrier shows
whichever warp is the writer, blocks alternate the order: even blocks run their threads from
the lowest index up, odd blocks from the highest down (and a barrier's waiters resume in the
order they arrived). And each block gets shared memory of its own, filled with 0xFF bytes (NaN
as a float): the stock simulator keeps one set of shared arrays for a whole launch, so a block
that read a tile before the warps copying it had run still found the previous block's copy of
that same tile there, and passed. The `cp.async` model of `_ops_sim.py` (copies land only at
the issuing thread's wait) does not depend on the schedule.

`install()` patches the simulator in this process only (the simulator test subprocess).
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Any

import greenlet
import numpy as np
from numba.core import types
from numba.cuda.simulator import kernel as sim_kernel
from numba.cuda.simulator import kernelapi
from numba.np import numpy_support

from kernels.cuda import _ops_sim

WARP = _ops_sim.WARP


class SimThread(greenlet.greenlet):
    """One GPU thread: the attributes the simulator's `cuda.*` stand-ins read from what they
    take for the current thread (`threadIdx`, `blockIdx`, `thread_id`, `_manager`)."""

    def __init__(self, block: _Block, manager: Any, block_idx: tuple, thread_idx: tuple,
                 target: Any) -> None:
        super().__init__(self._body, parent=greenlet.getcurrent())
        self.block = block
        self._manager = manager
        self._target = target
        self.blockIdx = kernelapi.Dim3(*block_idx)
        self.threadIdx = kernelapi.Dim3(*thread_idx)
        dim = kernelapi.Dim3(*manager._block_dim)
        self.thread_id = self.threadIdx.x + dim.x * (self.threadIdx.y + dim.y * self.threadIdx.z)
        self.exception: tuple[BaseException, Any] | None = None

    def _body(self) -> None:
        try:
            self._target()
        except Exception as error:   # noqa: BLE001 (reported by the launch, as the stock runner does)
            where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
            message = f"{where}: {error}" if str(error) else where
            try:
                wrapped = type(error)(message)
            except Exception:         # noqa: BLE001 (an exception type with another signature)
                wrapped = error
            self.exception = (wrapped, sys.exc_info()[2])
        finally:
            self.block.exited(self)

    def park(self) -> None:
        """Hand control back to the block's scheduler until something makes this thread
        ready again."""
        self.parent.switch()

    def syncthreads(self) -> None:
        self.block.syncthreads(self)

    # the simulator's own implementations read only threadIdx, _manager and syncthreads
    syncthreads_count = sim_kernel.BlockThread.syncthreads_count
    syncthreads_and = sim_kernel.BlockThread.syncthreads_and
    syncthreads_or = sim_kernel.BlockThread.syncthreads_or


class _Block:
    """The scheduler of one thread block's threads: a queue of ready threads, run in turn."""

    def __init__(self) -> None:
        self.ready: deque[SimThread] = deque()
        self.at_syncthreads: list[SimThread] = []
        self.num_live = 0
        self.shared: dict[tuple[str, int], np.ndarray] = {}  # declaring line -> array

    def shared_array(self, caller: tuple[str, int], shape: Any, dtype: np.dtype) -> np.ndarray:
        res = self.shared.get(caller)
        if res is None:
            res = self.shared[caller] = np.empty(shape, dtype)
            res.reshape(-1).view(np.uint8)[:] = _ops_sim.POISON   # NaN, as a cp.async in flight reads
        return res

    def syncthreads(self, thread: SimThread) -> None:
        self.at_syncthreads.append(thread)
        self._release_if_complete()
        thread.park()

    def exited(self, thread: SimThread) -> None:
        self.num_live -= 1
        self._release_if_complete()

    def _release_if_complete(self) -> None:
        if self.at_syncthreads and len(self.at_syncthreads) == self.num_live:
            self.ready.extend(self.at_syncthreads)
            self.at_syncthreads = []

    def run(self, threads: list[SimThread]) -> None:
        self.num_live = len(threads)
        self.ready.extend(threads)
        while self.ready:
            thread = self.ready.popleft()
            thread.switch()
            if thread.exception is not None:
                self._discard(threads)
                error, traceback = thread.exception
                raise error.with_traceback(traceback)
        if self.num_live:
            waiting = len(self.at_syncthreads)
            self._discard(threads)
            raise RuntimeError(
                f"deadlock: {self.num_live} threads of the block have not exited and none can "
                f"go on ({waiting} wait in __syncthreads, the others in warp collectives whose "
                f"warps do not all arrive): a barrier is not reached by every thread")

    @staticmethod
    def _discard(threads: list[SimThread]) -> None:
        for thread in threads:
            if thread and not thread.dead:
                thread.throw()   # GreenletExit: unwinds its frames here, not at garbage collection


class CoopWarpBarrier:
    """`_ops_sim._WarpBarrier` for greenlet threads: the 32nd lane to arrive runs
    `on_complete` (the warp-wide result) and goes on; the 31 parked lanes run next, ahead of
    the other warps, so a warp runs as far as it can (to a `__syncthreads`) before the next
    one starts: the schedule in which a missing block barrier lets a warp read what another
    has not written yet, or overwrite what another has not read."""

    __slots__ = ("parked",)

    def __init__(self) -> None:
        self.parked: list[SimThread] = []

    def wait(self, lane: int, on_complete: Any = None) -> None:
        thread = greenlet.getcurrent()
        if len(self.parked) == WARP - 1:
            parked, self.parked = self.parked, []
            if on_complete is not None:
                on_complete()
            thread.block.ready.extendleft(reversed(parked))   # this warp runs on ahead
        else:
            self.parked.append(thread)
            thread.park()


def _run_block(self: Any, grid_point: tuple, *args: Any) -> None:
    """`BlockManager.run`: one block's threads, to completion, on the calling OS thread."""
    def target() -> None:
        self._f(*args)

    block = _Block()
    threads = [SimThread(block, self, grid_point, block_point, target)
               for block_point in np.ndindex(*self._block_dim)]
    if np.ravel_multi_index(grid_point, self._grid_dim) % 2:
        threads.reverse()
    block.run(threads)


def _shared_array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> np.ndarray:
    """`cuda.shared.array`, found by the declaring line as in the stock simulator (but from the
    caller's frame, not a whole extracted stack), in the running block's own shared memory."""
    if alignment is not None or shape == 0:
        return _stock_shared_array(self, shape, dtype, alignment)  # not used by our kernels
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    return greenlet.getcurrent().block.shared_array((frame.f_code.co_filename, frame.f_lineno),
                                                    shape, dtype)


_stock_shared_array = kernelapi.FakeCUDAShared.array
_os_current_thread = threading.current_thread


def _current_thread() -> Any:
    """The simulated GPU thread when called from one, else the OS thread (the simulator's
    `cuda.threadIdx` & co. and `_ops_sim` look their thread up through this)."""
    current = greenlet.getcurrent()
    return current if type(current) is SimThread else _os_current_thread()


def install() -> None:
    threading.current_thread = _current_thread
    kernelapi.FakeCUDAShared.array = _shared_array
    sim_kernel.BlockManager.run = _run_block
    _ops_sim._WarpBarrier = CoopWarpBarrier
