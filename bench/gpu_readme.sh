#!/usr/bin/env bash
# The README's runnable blocks on a GPU host, where device "auto" picks cuda: what a newcomer
# with a GPU runs first (model_init, LLM, pagedkv-serve + curl, the services + admin CLI, the
# examples). tests/test_readme.py links the clone's `.venv` to the interpreter running it, so
# this builds a venv-shaped prefix around the host's python (its packages and PYTHONPATH, via a
# .pth file, since the test sets PYTHONPATH itself) holding this project's console scripts, and
# runs that test from it. Installs nothing from the network.
# Usage: bench/gpu_readme.sh [pytest args]   (PYTHON picks the interpreter; default python3)
# Set PAGEDKV_README_TIMEOUT_S below the device call's limit: the test then fails with the
# output so far (which block was running) instead of being killed silently.
# 2026-12-04, H200: the blocks had not finished after 200 s (17 s on a 2-core CPU host); why is
# not known yet: the first thing to look at with the next GPU.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
host_py="$(command -v "${PYTHON:-python3}")"
prefix="$(mktemp -d)/venv"
"$host_py" -m venv --without-pip "$prefix"
site="$("$prefix/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# every import path of the host interpreter, the repository first; its site directories through
# site.addsitedir, so their own .pth files run too (numba-cuda's redirect of numba.cuda is one)
{ echo "$repo"; "$host_py" -c '
import sys
for p in filter(None, sys.path):
    print(f"import site; site.addsitedir({p!r})" if p.endswith(("site-packages", "dist-packages")) else p)
'; } > "$site/host-python.pth"
# console scripts from pyproject.toml's [project.scripts]
"$prefix/bin/python" - "$repo/pyproject.toml" "$prefix/bin" <<'PY'
import sys
import tomllib
from pathlib import Path

scripts = tomllib.loads(Path(sys.argv[1]).read_text())["project"]["scripts"]
bin_dir = Path(sys.argv[2])
for name, target in scripts.items():
    module, func = target.split(":")
    path = bin_dir / name
    path.write_text(f"#!{bin_dir / 'python'}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    path.chmod(0o755)
PY
cd "$repo"
exec "$prefix/bin/python" -m pytest tests/test_readme.py -p no:cacheprovider -o addopts=-ra "$@"
