"""Runs the CUDA kernel tests (tests/kernels/cuda_sim) in Numba's CUDA simulator.

The simulator must be enabled before numba is first imported, and this process already uses
real Numba for the CPU kernels, so the simulator suite runs in a subprocess with
NUMBA_ENABLE_CUDASIM=1. Its own output is shown when it fails. One subprocess for the whole
folder: with thread blocks run as greenlets (cuda_sim/coop_runner.py) it takes ~20 s, and a
second subprocess side by side would pay the simulator's start-up (~3.5 CPU-s) again for
little wall time. `--slow` is passed down.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("numba_cuda") is None:   # [dev] installs Numba CUDA on Linux only
    pytest.skip("needs numba-cuda (its CUDA bindings ship Linux wheels only)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SIM_TESTS = "tests/kernels/cuda_sim"
TIMEOUT_S = 600  # ~20 s on the 2-core CI machine (~35 s with --slow); generous for a loaded host


@pytest.mark.timeout(TIMEOUT_S + 60)  # the project default (300 s) could be short on a loaded host
def test_cuda_kernels_in_simulator(request: pytest.FixtureRequest) -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    slow = ["--slow"] if request.config.getoption("--slow") else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", SIM_TESTS, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--timeout", str(TIMEOUT_S), "-o", "addopts=-ra", *slow],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 30, check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1:] or ["<no output>"]
    assert proc.returncode == 0, (
        f"simulator suite failed ({summary[0]}):\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    )
    assert " passed" in summary[0], summary[0]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("--slow" in line for line in skipped), skipped      # only the --slow cases may skip
