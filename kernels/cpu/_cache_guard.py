"""Drop stale Numba on-disk caches of the CPU kernels when any kernel source file changed.

Numba's `cache=True` keys a cached kernel on its *own* file's timestamp only: editing a helper
in `_tile.py` would leave `decode.py`'s cached machine code (with the old helper inlined)
silently in use. Before the kernels are imported we hash every source file of this package and
clear the package's cache files when the hash differs from the one recorded last time. Only the
default cache location (`__pycache__` next to the sources) is managed; with `NUMBA_CACHE_DIR`
set, whoever sets it owns its invalidation.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_STAMP_NAME = "kernel-sources.sha256"


def _sources_digest(package_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package_dir.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def clear_stale_caches(package_dir: Path = _PACKAGE_DIR) -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    cache_dir = package_dir / "__pycache__"
    stamp = cache_dir / _STAMP_NAME
    current = _sources_digest(package_dir)
    try:
        if stamp.read_text() == current:
            return
    except OSError:
        pass  # first run, or unreadable: fall through and rebuild the stamp
    try:
        cache_dir.mkdir(exist_ok=True)
        for pattern in ("*.nbi", "*.nbc"):
            for cached in cache_dir.glob(pattern):
                cached.unlink(missing_ok=True)
        stamp.write_text(current)
    except OSError:
        return  # read-only install: Numba then falls back to compiling in memory
