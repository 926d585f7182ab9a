"""The Numba cache guard drops cached kernels exactly when a kernel source file changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels.cpu._cache_guard import clear_stale_caches


def test_caches_cleared_only_after_a_source_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    (tmp_path / "helper.py").write_text("X = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    entry = cache / "decode._kernel-1.py311.nbi"
    entry.write_text("cached")
    clear_stale_caches(tmp_path)  # no stamp yet: unknown provenance, cleared
    assert not entry.exists()
    entry.write_text("cached")
    clear_stale_caches(tmp_path)  # sources unchanged: kept
    assert entry.exists()
    (tmp_path / "helper.py").write_text("X = 2\n")
    clear_stale_caches(tmp_path)  # a helper changed: cleared
    assert not entry.exists()
