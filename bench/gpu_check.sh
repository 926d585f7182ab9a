#!/usr/bin/env bash
# GPU check of the kernels and the engine (issue 43 item 4): correctness against the float64
# reference, kernel-only decode and prefill timings against copy bandwidth and torch SDPA, a
# million-token context, host µs per launch path, and the engine on a bf16 1B-shaped model vs
# transformers. One command, under 5 minutes; phases and budgets: bench/gpu_check.py's doc.
# Needs an NVIDIA GPU with numba, numba-cuda and torch (the engine phases also safetensors,
# tokenizers, transformers); downloads nothing.
#
# Usage: bench/gpu_check.sh RESULTS_DIR [gpu_check.py options]
#   On the device tool (carry [".whl"], built here by bench/gpu_wheels.sh; what is under $OUT
#   comes back):  WHEELS_DIR=.whl PYTHON=python3 bench/gpu_check.sh "$OUT/gpu_check"
#   Dry run without a GPU: bench/gpu_check.sh RESULTS_DIR --cpu-smoke
# WHEELS_DIR: install those wheels (no network, no dependencies) into SITE_DIR (default: a
# fresh temporary directory) put first on PYTHONPATH: the H200 image's numpy 2.5 compiles no
# kernel under numba-cuda 0.30.4, and the engine imports packages the image lacks. A README run
# after it in the same call reuses them:
#   SITE_DIR=/tmp/site WHEELS_DIR=.whl PYTHON=python3 bench/gpu_check.sh "$OUT/gpu_check";
#   PYTHONPATH=/tmp/site PAGEDKV_README_TIMEOUT_S=150 PYTHON=python3 bench/gpu_readme.sh -x
# Results: RESULTS_DIR/gpu_check.jsonl (one line per measurement, written as measured),
# gpu_check.json and gpu_check.md (rewritten after every phase), gpu_check.log (stdout+stderr).
# The caller's PYTHONPATH is kept after the repository (packages carried to a GPU host).
# DEADLINE_S (default 280) is the script's own deadline: phases that would not fit are skipped;
# HARD_LIMIT_S (default DEADLINE_S + 40) kills it if a phase overruns anyway, and what it wrote
# until then stays. Exit status: 0 ok, 1 a correctness check failed, 2 no GPU, 3 WHEELS_DIR
# would not install, 124 killed.
set -uo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: $0 RESULTS_DIR [gpu_check.py options]" >&2
    exit 64
fi
out="$1"
shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [ -n "${WHEELS_DIR:-}" ]; then
    site="${SITE_DIR:-$(mktemp -d)/site}"
    "${PYTHON:-python}" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "$WHEELS_DIR"/*.whl || { echo "gpu_check: installing $WHEELS_DIR failed" >&2; exit 3; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
deadline="${DEADLINE_S:-280}"
hard="${HARD_LIMIT_S:-$((${deadline%.*} + 40))}"
status=0
# stdout goes to the terminal (the device tool returns its tail) and to the results directory;
# the directory is created by gpu_check.py only once a GPU is found (the log waits for it).
tmp_log="$(mktemp)"
timeout --signal=TERM --kill-after=10 "$hard" \
    "${PYTHON:-python}" bench/gpu_check.py --out "$out" --deadline-s "$deadline" "$@" 2>&1 \
    | tee "$tmp_log"
status="${PIPESTATUS[0]}"
if [ -d "$out" ]; then
    cp "$tmp_log" "$out/gpu_check.log"
fi
rm -f "$tmp_log"
exit "$status"
