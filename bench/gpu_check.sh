#!/usr/bin/env bash
# GPU check of the Numba CUDA kernels: correctness against the float64 reference at full
# size, then decode-attention bandwidth vs the device's copy bandwidth and torch SDPA.
# Needs an NVIDIA GPU with numba, numba-cuda and torch installed; downloads nothing.
# Usage: bench/gpu_check.sh RESULTS_DIR   (exit status != 0 when a correctness check fails)
# The caller's PYTHONPATH is kept after the repository (packages carried to a GPU host);
# ENGINE_TIMEOUT caps the engine benchmark (seconds, default 240).
set -euo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: $0 RESULTS_DIR [extra gpu_check.py options]" >&2
    exit 64
fi
out="$1"
shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
status=0
"${PYTHON:-python}" bench/gpu_check.py --out "$out" "$@" || status=$?
# 2: no CUDA GPU here (said on stderr); the engine benchmark on cuda would only fail after
# importing transformers.
[ "$status" -eq 2 ] && exit 2
# The engine on the GPU vs transformers (issue 12), when the model stack travelled along
# (safetensors, tokenizers, transformers: pass them in with the device tool's `carry`).
if "${PYTHON:-python}" -c "import safetensors, tokenizers, transformers" 2>/dev/null; then
    timeout "${ENGINE_TIMEOUT:-240}" "${PYTHON:-python}" bench/bench_engine.py --device cuda --requests 16 --repeats 1 \
        > "$out/bench_engine_cuda.txt" 2>&1 || echo "bench_engine on cuda failed: see $out/bench_engine_cuda.txt" >&2
else
    echo "bench_engine skipped: safetensors/tokenizers/transformers not importable" > "$out/bench_engine_cuda.txt"
fi
exit "$status"
