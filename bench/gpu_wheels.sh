#!/usr/bin/env bash
# Wheels for a GPU host that has no network (the device tool's H200 image), into .whl/ (kept
# out of git by .git/info/exclude). That image has torch, numba, numba-cuda, safetensors,
# tokenizers, transformers and pytest, but numpy 2.5, under which numba-cuda 0.30.4 compiles no
# kernel, and none of what the services and the engine import beyond them. Versions come from
# scripts/constraints.txt, so the GPU host runs what CI runs.
# Then, there: pip install --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#              && export PYTHONPATH=/tmp/site   (bench/gpu_check.sh and gpu_readme.sh keep it)
# Usage: bench/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12: the H200 image's python3)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
names=(numpy grpcio grpcio-tools grpcio-health-checking grpcio-reflection protobuf structlog
       pydantic pydantic-core pydantic-settings annotated-types typing-inspection typing-extensions
       sqlalchemy greenlet python-dotenv alembic mako fastapi starlette uvicorn annotated-doc
       sniffio anyio h11 pytest-asyncio)
pins=()
for name in "${names[@]}"; do
    # constraints.txt spells some names with _ or capitals; pip's normalisation treats them alike
    pattern="^$(echo "$name" | sed 's/[-_]/[-_]/g')=="
    pin="$(grep -i -E "$pattern" scripts/constraints.txt | head -n 1)"
    if [ -z "$pin" ]; then
        echo "gpu_wheels: $name has no pin in scripts/constraints.txt" >&2
        exit 1
    fi
    pins+=("$pin")
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version "${1:-3.12}" \
    --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
echo "gpu_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (the device tool carries at most 64 MiB)"
