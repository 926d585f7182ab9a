"""Simulator-only tests: collected only when NUMBA_ENABLE_CUDASIM=1 was set before numba loaded.

The main pytest process runs without the simulator (the CPU kernels need real Numba), so it
skips this folder; `tests/kernels/test_cuda_simulator.py` runs it in a subprocess with the
variable set.
"""

import os
import sys

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if not SIMULATOR:
    collect_ignore_glob = ["test_*.py"]
else:
    # One OS thread per simulated GPU thread: a short switch interval hands over faster.
    sys.setswitchinterval(5e-4)
