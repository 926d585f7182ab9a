"""One PTX build per kernel variant per test run (see `bench/kernel_sass.py: variant_ptx`).

test_cuda_compile_ptx.py and test_kernel_sass.py compile several of the same variants, and
compiling is most of their cost. The directory lies under this run's pytest temporary
directory, shared by the pytest-xdist workers (each worker's own base directory is one level
below it), so no PTX outlives the run or leaks into the repository.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def ptx_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_PTX_CACHE_DIR", os.fspath(run_dir / "ptx-cache"))
        yield
