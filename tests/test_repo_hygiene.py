"""Files a run leaves in the working tree are ignored by git (issue 10: the SQLite store's
lock file `block_manager.db.lock` showed up in `git status`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "path", ["block_manager.db", "block_manager.db-wal", "block_manager.db-shm", "block_manager.db.lock",
             "pagedkv-demo.svg", "certs/dev/ca-key.pem", "certs/dev/admin.pem"],
)
def test_run_artifacts_are_ignored(path: str) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, timeout=30)
    assert result.returncode == 0, f"{path} is not ignored by .gitignore"
