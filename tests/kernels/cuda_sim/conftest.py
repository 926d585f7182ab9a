"""Simulator-only tests: collected only when NUMBA_ENABLE_CUDASIM=1 was set before numba loaded.

The main pytest process runs without the simulator (the CPU kernels need real Numba), so it
skips this folder; `tests/kernels/test_cuda_simulator.py` runs it in a subprocess with the
variable set.

Test-only fix to the simulator: its `cuda.shared.array` looks an allocation up by call site
and creates it if missing without a lock, so two simulated threads of one block can each
create their own copy of "the" shared array (a check-then-set race that real GPUs do not
have). We install the same lookup under a lock; the kernels are unchanged.
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
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    # One OS thread per simulated GPU thread: a short switch interval hands over faster.
    sys.setswitchinterval(5e-4)
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
