"""The CPU kernels' on-disk cache: invalidated by any source file of the package, never by
deleting files, and importing the package touches nothing on disk."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import kernels.cpu
from kernels.cpu._cache import package_digest
from tests.support import fork_server

REPO = Path(__file__).resolve().parents[2]

KERNEL = textwrap.dedent("""
    import sys
    from kernels.cpu._cache import njit_cached
    from helper import OFFSET

    @njit_cached()
    def add(x):
        return x + OFFSET

    print(add(1), add.stats.cache_hits.get(add.signatures[0], 0) if add.signatures else 0)
""")


def _run(package: Path) -> tuple[int, int]:
    """`kern.py` in a new process (each a fresh dispatcher: what it loads comes from the disk).
    No .pyc: helper.py is rewritten at the same size within the second, which Python's own
    bytecode check (mtime in seconds, size) cannot tell from the file it compiled."""
    env = dict(os.environ, PYTHONPATH=f"{package}{os.pathsep}{REPO}", PYTHONDONTWRITEBYTECODE="1")
    env.pop("NUMBA_CACHE_DIR", None)
    out = fork_server.run([sys.executable, "-m", "kern"], env=env, cwd=package, check=True, text=True,
                          timeout=120).stdout.split()
    return int(out[0]), int(out[1])


def test_a_changed_helper_recompiles_instead_of_loading_stale_code(tmp_path: Path) -> None:
    (tmp_path / "kern.py").write_text(KERNEL)
    (tmp_path / "helper.py").write_text("OFFSET = 10\n")
    assert _run(tmp_path) == (11, 0)  # compiled and cached
    assert list((tmp_path / "__pycache__").glob("kern.add-*.nbi"))
    assert _run(tmp_path) == (11, 1)  # loaded from the cache
    (tmp_path / "helper.py").write_text("OFFSET = 20\n")  # only the helper changes
    assert _run(tmp_path) == (21, 0)  # stale entry ignored: recompiled with the new helper
    assert _run(tmp_path) == (21, 1)


def test_digest_follows_sibling_sources(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("X = 1\n")
    first = package_digest(tmp_path)
    assert package_digest(tmp_path) == first
    (tmp_path / "b.py").write_text("Y = 2\n")
    second = package_digest(tmp_path)
    assert second != first
    (tmp_path / "b.py").write_text("Y = 3\n")
    assert package_digest(tmp_path) not in (first, second)


def test_import_has_no_side_effects_and_modules_are_not_shadowed() -> None:
    cache_dir = Path(kernels.cpu.__file__).parent / "__pycache__"
    before = sorted(p.name for p in cache_dir.glob("*")) if cache_dir.exists() else []
    code = ("import kernels.cpu, kernels.cpu.api, types; "
            "assert isinstance(kernels.cpu.decode, types.ModuleType); "
            "assert isinstance(kernels.cpu.write_slots, types.ModuleType); "
            "assert isinstance(kernels.cpu.copy_blocks, types.ModuleType); "
            "assert callable(kernels.cpu.api.copy_blocks)")
    fork_server.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                    env=dict(os.environ, PYTHONPATH=str(REPO)))
    after = sorted(p.name for p in cache_dir.glob("*")) if cache_dir.exists() else []
    assert set(before) <= set(after), f"import removed {set(before) - set(after)}"
