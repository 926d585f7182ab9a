"""What gets installed: no other distribution brings one of our top-level import names, and
scripts/constraints.txt (the versions run.sh installs) stays inside pyproject.toml's ranges.

Why: our top level is fixed (`kernels/`, `engine/`, `demo/`, ...) and three of those names are
common words. transformers 5.25 began to require Hugging Face's `kernels` distribution: in the
test venv, transformers then imported *our* `kernels` package and 51 tests failed with an
ImportError deep inside transformers; in a wheel install the two packages would overwrite each
other's files. pyproject.toml caps transformers below 5.25 for that reason. This test names the
clash in one line instead, whichever dependency brings it next time.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what the wheel installs at top level (`block_manager*` -> block_manager), so a new package is checked too
TOP_LEVEL_PACKAGES = tuple(p.removesuffix("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
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
    extras = PYPROJECT["project"]["optional-dependencies"]
    transformers = [req for req in extras["demo"] if req.startswith("transformers")]
    assert transformers == ["transformers>=4.45,<5.25"], extras["demo"]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"not a name==version pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_every_pin_of_the_lock_is_within_pyproject_ranges() -> None:
    """scripts/constraints.txt (run.sh's `pip -c`) may only choose inside pyproject.toml's
    ranges, or the venv run.sh builds would differ from what `pip install pagedkv` allows."""
    project = PYPROJECT["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = _pins()
    outside = [f"{req} vs {pins[canonicalize_name(req.name)]}" for req in requirements
               if canonicalize_name(req.name) in pins
               and not req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)]
    assert outside == []
    assert canonicalize_name(OUR_DISTRIBUTION) not in pins
    # torch is installed first, by itself: the same version as run.sh's own pin
    torch_pin = re.search(r'"torch==([0-9.]+)"', (ROOT / "scripts" / "run.sh").read_text())
    assert torch_pin and pins["torch"] == torch_pin.group(1)
    # torch's CUDA build pins these itself (cuda-toolkit==13.0.3 for 2.13.0): a pin here conflicts
    assert not [name for name in pins if name.startswith("nvidia-") or name == "cuda-toolkit"]


def test_run_sh_refuses_a_missing_constraints_file_before_creating_anything(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run.sh"), "setup"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, env={**os.environ, "PAGEDKV_VENV": str(venv), "PAGEDKV_CONSTRAINTS": "pins.txt"},
    )
    assert result.returncode == 2
    assert result.stderr == f"run.sh: error: constraints file {tmp_path}/pins.txt not found (PAGEDKV_CONSTRAINTS)\n"
    assert not venv.exists()
