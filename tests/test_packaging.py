"""No other installed distribution brings one of our top-level import names.

Why: our top level is fixed (`kernels/`, `engine/`, `demo/`, ...) and two of those names are
common words. transformers 5.25 began to require Hugging Face's `kernels` distribution: in the
test venv, transformers then imported *our* `kernels` package and 51 tests failed with an
ImportError deep inside transformers; in a wheel install the two packages would overwrite each
other's files. pyproject.toml caps transformers below 5.25 for that reason. This test names the
clash in one line instead, whichever dependency brings it next time.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_PACKAGES = ("block_manager", "compute_node", "demo", "engine", "kernels", "pagedkv")
OUR_DISTRIBUTION = "pagedkv"


def foreign_owners(package_map: dict[str, list[str]]) -> dict[str, list[str]]:
    """For each of our top-level import names, the other distributions that also provide it."""
    clashes = {}
    for name in TOP_LEVEL_PACKAGES:
        others = sorted({dist for dist in package_map.get(name, []) if dist.lower() != OUR_DISTRIBUTION})
        if others:
            clashes[name] = others
    return clashes


def test_no_installed_distribution_shadows_a_top_level_package() -> None:
    clashes = foreign_owners(importlib.metadata.packages_distributions())
    assert not clashes, (
        "installed distributions provide our top-level import names (one shadows the other): "
        + "; ".join(f"`{name}` also from {', '.join(dists)}" for name, dists in clashes.items())
        + " -- pin the dependency that pulls them in (see pyproject.toml, [demo])"
    )


def test_a_foreign_kernels_distribution_is_reported(tmp_path: Path) -> None:
    """The check above can fail: a distribution like Hugging Face's `kernels` 0.19 (a
    dist-info declaring top-level `kernels`) placed on the path is named as a clash."""
    dist_info = tmp_path / "kernels-0.19.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    (dist_info / "top_level.txt").write_text("kernels\n")
    code = (
        "import importlib.metadata, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.test_packaging import foreign_owners\n"
        "print(foreign_owners(importlib.metadata.packages_distributions()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'kernels': ['kernels']}"


def test_the_demo_extra_keeps_transformers_below_the_kernels_requirement() -> None:
    """Without the cap a fresh venv resolves the newest transformers and the first test fails
    only there (CI), not in a developer's older venv."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    transformers = [req for req in extras["demo"] if req.startswith("transformers")]
    assert transformers == ["transformers>=4.45,<5.25"], extras["demo"]
