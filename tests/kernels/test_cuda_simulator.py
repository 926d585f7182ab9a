"""Runs the CUDA kernel tests (tests/kernels/cuda_sim) in Numba's CUDA simulator.

The simulator must be enabled before numba is first imported, and this process already uses
real Numba for the CPU kernels, so the simulator suite runs in a subprocess with
NUMBA_ENABLE_CUDASIM=1. Its own output is shown when it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIM_TESTS = "tests/kernels/cuda_sim"
TIMEOUT_S = 1200  # the suite takes ~4 minutes on the 2-core CI machine (FA2 prefill: ~2 of them)


@pytest.mark.timeout(TIMEOUT_S + 60)  # the project default (300 s) is below the suite's time
def test_cuda_kernels_in_simulator() -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", SIM_TESTS, "-q", "-p", "no:cacheprovider",
         "--timeout", str(TIMEOUT_S)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 30, check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1:] or ["<no output>"]
    assert proc.returncode == 0, (
        f"simulator suite failed ({summary[0]}):\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    )
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]
