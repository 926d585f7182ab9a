"""Runs the CUDA kernel tests (tests/kernels/cuda_sim) in Numba's CUDA simulator.

The simulator must be enabled before numba is first imported, and this process already uses
real Numba for the CPU kernels, so the simulator suite runs in a subprocess with
NUMBA_ENABLE_CUDASIM=1. Its own output is shown when it fails. One subprocess per simulator
test file (found by name, so a new file is picked up): pytest-xdist spreads them over the
cores instead of one long serial run; `--slow` is passed down.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIM_TESTS = "tests/kernels/cuda_sim"
TIMEOUT_S = 600  # the whole simulator suite took ~2 minutes serially on the 2-core CI machine
SIM_FILES = sorted(p.name for p in (REPO / SIM_TESTS).glob("test_*.py"))


@pytest.mark.parametrize("sim_file", SIM_FILES)
def test_cuda_kernels_in_simulator(sim_file: str, request: pytest.FixtureRequest) -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    slow = ["--slow"] if request.config.getoption("--slow") else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"{SIM_TESTS}/{sim_file}", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--timeout", str(TIMEOUT_S), "-o", "addopts=", *slow],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 30, check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1:] or ["<no output>"]
    assert proc.returncode == 0, (
        f"simulator suite failed ({summary[0]}):\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    )
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]
