"""Scripts under bench/ loaded as modules by the kernel tests (bench/ is not a package: each
script is loaded from its file once and registered under its own name, so a second test file
asking for it gets the same module)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as the module `name` (loaded once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"bench/{name}.py cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
