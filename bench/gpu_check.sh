#!/usr/bin/env bash
# GPU check of the Numba CUDA kernels: correctness against the float64 reference at full
# size, then decode-attention bandwidth vs the device's copy bandwidth and torch SDPA.
# Needs an NVIDIA GPU with numba, numba-cuda and torch installed; downloads nothing.
# Usage: bench/gpu_check.sh RESULTS_DIR   (exit status != 0 when a correctness check fails)
set -euo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: $0 RESULTS_DIR [extra gpu_check.py options]" >&2
    exit 64
fi
out="$1"
shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PYTHONPATH=. exec "${PYTHON:-python}" bench/gpu_check.py --out "$out" "$@"
