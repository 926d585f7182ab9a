"""Runs the CUDA kernel tests (tests/kernels/cuda_sim) in Numba's CUDA simulator.

The simulator must be enabled before numba is first imported, and this process already uses
real Numba for the CPU kernels, so the simulator suite runs in a subprocess with
NUMBA_ENABLE_CUDASIM=1. Its own output is shown when it fails. Two subprocesses, the largest
simulator test file alone and the others together (found by name, so a new file is picked up):
pytest-xdist runs them side by side instead of one long serial run, and each subprocess pays
the simulator's start-up once. `--slow` is passed down.
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
TIMEOUT_S = 1200  # a group takes a few minutes on the 2-core CI machine (FA2 prefill: ~2 of them)
_FILES = sorted((REPO / SIM_TESTS).glob("test_*.py"), key=lambda p: -p.stat().st_size)
SIM_GROUPS = {"largest": [p.name for p in _FILES[:1]], "others": sorted(p.name for p in _FILES[1:])}


def _run_simulator(group: str, request: pytest.FixtureRequest) -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    slow = ["--slow"] if request.config.getoption("--slow") else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *(f"{SIM_TESTS}/{f}" for f in SIM_GROUPS[group]), "-q", "-p",
         "no:cacheprovider", "-p", "no:xdist",
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


# One class per group: `--dist loadscope` (scripts/run.sh test) schedules by class, so the two
# groups go to different workers; as two tests of one module they would share a worker.
class TestSimulatorLargestFile:
    @pytest.mark.timeout(TIMEOUT_S + 60)  # the project default (300 s) is below a group's time
    def test_cuda_kernels_in_simulator(self, request: pytest.FixtureRequest) -> None:
        _run_simulator("largest", request)


class TestSimulatorOtherFiles:
    @pytest.mark.timeout(TIMEOUT_S + 60)
    def test_cuda_kernels_in_simulator(self, request: pytest.FixtureRequest) -> None:
        if not SIM_GROUPS["others"]:
            pytest.skip("one simulator test file only")
        _run_simulator("others", request)
