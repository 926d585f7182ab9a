"""Simulator-only tests: collected only when NUMBA_ENABLE_CUDASIM=1 was set before numba loaded.

The main pytest process runs without the simulator (the CPU kernels need real Numba), so it
skips this folder; `tests/kernels/test_cuda_simulator.py` runs it in a subprocess with the
variable set.

Here the simulator runs each thread block's threads as greenlets on one OS thread instead of
one OS thread per GPU thread (`coop_runner.py`: same barrier rules, no GIL hand-offs). The
kernels are unchanged; their machine operations are the simulator twins of
`kernels/cuda/_ops_sim.py`.
"""

import os

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if not SIMULATOR:
    collect_ignore_glob = ["test_*.py"]
else:
    from coop_runner import install

    install()
