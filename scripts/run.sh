#!/usr/bin/env bash
# One entry point for people and CI: sets up .venv (torch==2.13.0 first, then the project with
# the extras the command needs) if needed, then runs the main job (`demo`) or the test suite
# (`test`); `setup` only installs (the Dockerfile uses it, so images install exactly as people do).
#
#   extras: test -> dev (pytest, ruff, the CUDA simulator's compiler pieces, transformers),
#           demo -> demo (transformers), setup -> $PAGEDKV_EXTRAS (default: none;
#           the GPU image passes "cuda").
#
# torch: plain `pip install torch==2.13.0` takes whatever build pip's indexes offer first: on
# Linux x86_64 from PyPI that is the CUDA build (several GB). PAGEDKV_TORCH_INDEX adds an index,
# e.g. PAGEDKV_TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build (~750 MB) on
# a host without a GPU. The build installed is printed either way.
#
# Versions: every pip install here takes scripts/constraints.txt (-c), the environment the
# suite last passed with, so a fresh clone installs what was tested; PAGEDKV_CONSTRAINTS names
# another file, or, set empty, lets pip take the newest releases within pyproject.toml's ranges.
#
# demo and test venvs install with --no-compile: pip would otherwise write ~300 MB of .pyc for
# every module of every package (a fifth of the demo venv), most never imported; run.sh writes
# those the services, engine and reference model import, once, right after (below). `setup`
# (the images) lets pip write them all: a container may not write them later.
# So does any venv built under PYTHONDONTWRITEBYTECODE: Python writes no .pyc then, and every
# process would compile torch & co. from source on every import (it cost CI ~40% more CPU).
set -euo pipefail
caller_dir=$PWD   # the demo writes its plot where it was started from, not into the repository
cd "$(dirname "$0")/.."
VENV=${PAGEDKV_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
cmd=${1:-demo}
shift || true
case "$cmd" in
  setup) extras=${PAGEDKV_EXTRAS:-} ;;
  demo) extras=demo ;;
  test) extras=dev ;;
  *) echo "usage: scripts/run.sh setup|demo|test [args...]" >&2; exit 2 ;;
esac
stamp="$VENV/.pagedkv-installed${extras:+-$extras}"
constraints=${PAGEDKV_CONSTRAINTS-$PWD/scripts/constraints.txt}
case "$constraints" in ""|/*) ;; *) constraints="$caller_dir/$constraints" ;; esac
pins=()
if [ -n "$constraints" ]; then
  [ -f "$constraints" ] || { echo "run.sh: error: constraints file $constraints not found (PAGEDKV_CONSTRAINTS)" >&2; exit 2; }
  pins=(-c "$constraints")
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "run.sh: creating $VENV (first run: a few minutes; ~950 MB for the demo, ~1.8 GB with the test extras)" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ -n "$constraints" ] && [ "$constraints" -nt "$stamp" ]; }; then
  echo "run.sh: installing torch==2.13.0 and pagedkv${extras:+[$extras]} into $VENV" >&2
  "$VENV/bin/pip" install -q --upgrade pip
  # torch first, pinned: the project's range would otherwise let pip pick any build.
  torch_index=()
  [ -n "${PAGEDKV_TORCH_INDEX:-}" ] && torch_index=(--extra-index-url "$PAGEDKV_TORCH_INDEX")
  no_compile=()
  [ "$cmd" != setup ] && [ -z "${PYTHONDONTWRITEBYTECODE:-}" ] && no_compile=(--no-compile)
  "$VENV/bin/pip" install --progress-bar on ${no_compile[@]+"${no_compile[@]}"} ${pins[@]+"${pins[@]}"} \
    ${torch_index[@]+"${torch_index[@]}"} "torch==2.13.0" 2>&1 \
    | grep -v "^Requirement already satisfied" || true
  "$VENV/bin/python" -c 'import torch; c = torch.version.cuda
print("run.sh: torch", torch.__version__, f"(CUDA {c} build)" if c else "(CPU build)")' >&2 || true
  "$VENV/bin/pip" install --progress-bar on ${no_compile[@]+"${no_compile[@]}"} ${pins[@]+"${pins[@]}"} \
    -e ".${extras:+[$extras]}" 2>&1 \
    | grep -E "^(Collecting|Successfully|ERROR)" || true
  "$VENV/bin/python" -c "import pagedkv" 2>/dev/null || { echo "run.sh: install failed" >&2; exit 1; }
  # Trimmed for size (the demo venv stays under 1 GB): torch's C++ side for building extensions
  # and its own tests (headers, gtest binaries, protoc: ~195 MB of the CPU build; nothing here
  # compiles against torch), and the static symbol tables of the three largest libraries
  # (~110 MB; the dynamic symbols stay). Only those: strip breaks libraries that auditwheel
  # rewrote (numpy's openblas). `pip install --force-reinstall --no-deps torch==2.13.0 llvmlite`
  # undoes it all; so does run.sh itself if the trimmed libraries fail to load.
  if [ "$cmd" != setup ]; then
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$site/torch/test" "$site/torch/include"
    find "$site/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} + 2>/dev/null || true
    if [ "$(uname -s)" = Linux ] && command -v strip >/dev/null; then
      for so in "$site"/torch/lib/libtorch_{cpu,python}.so "$site"/llvmlite/binding/libllvmlite.so; do
        [ -f "$so" ] && strip --strip-unneeded "$so" || true
      done
      "$VENV/bin/python" -c 'import torch, llvmlite.binding as b; b.initialize_native_target()' 2>/dev/null \
        || "$VENV/bin/pip" install -q --force-reinstall --no-deps ${torch_index[@]+"${torch_index[@]}"} \
             "torch==2.13.0" "llvmlite==$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("llvmlite"))')"
    fi
  fi
  # Bytecode for what runs, written once: installed with --no-compile, the venv has no .pyc, and
  # a first test run starts ~8 processes (workers, simulator groups, fork servers, the kernel
  # warm-up) that each compile torch & co. to bytecode side by side before any has written it
  # (~5 CPU-s more per process). One import of the services, the engine and the reference model
  # here writes the .pyc of just those modules (~80 MB for the test venv; a demo run writes the
  # same ones itself); for `test` also the test tools' (pytest & plugins, hypothesis, the openai
  # client: ~1,200 modules both workers compiled side by side in a fresh clone's first run).
  if [ ${#no_compile[@]} -gt 0 ]; then
    prime="import compute_node.service.server, block_manager.service.server, demo.cli, transformers.models.llama.modeling_llama"
    [ "$cmd" = test ] && prime="$prime, engine.api.server, pytest, xdist, hypothesis, openai, httpx, psycopg, kubernetes_validate, kernels.cuda"
    "$VENV/bin/python" -c "$prime" >/dev/null 2>&1 || true
  fi
  touch "$stamp"
  echo "run.sh: $VENV ready ($(du -sh "$VENV" 2>/dev/null | cut -f1))" >&2
fi
export PATH="$VENV/bin:$PATH"
case "$cmd" in
  setup) exit 0 ;;
  demo) cd "$caller_dir" && exec "$VENV/bin/pagedkv-demo" "$@" ;;
  # -n auto: one pytest-xdist worker per core (most tests wait on service processes); loadscope
  # keeps a module's tests on one worker so its module-scoped stack or server is built once.
  # Later arguments win: `./scripts/run.sh test -n 0` runs serially. One torch thread per
  # process (unless set): the workers and the services they start already fill the cores, and
  # torch's spinning intra-op threads only add CPU time there. Bytecode is written (even under
  # PYTHONDONTWRITEBYTECODE; __pycache__ is git-ignored): otherwise every worker's collection
  # rewrites and compiles every test module again (17.7 instead of 12.3 CPU-s per collection).
  test) export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        unset PYTHONDONTWRITEBYTECODE
        exec "$VENV/bin/python" -m pytest -n auto --dist loadscope "$@" ;;
esac
