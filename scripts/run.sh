#!/usr/bin/env bash
# One entry point for people and CI: sets up .venv (torch==2.13.0 first, then the project with
# the extras the command needs) if needed, then runs the main job (`demo`) or the test suite
# (`test`); `setup` only installs (the Dockerfile uses it, so images install exactly as people do).
#
#   extras: test -> dev (pytest, ruff, the CUDA simulator's compiler pieces, transformers),
#           demo -> demo, setup -> $PAGEDKV_EXTRAS (default: none; the GPU image passes "cuda").
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
if [ ! -x "$VENV/bin/python" ]; then
  echo "run.sh: creating $VENV (first run: a few minutes; about 1.5 GB with the test extras)" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "run.sh: installing torch==2.13.0 (CPU build) and pagedkv${extras:+[$extras]} into $VENV" >&2
  "$VENV/bin/pip" install -q --upgrade pip
  # The CPU build of torch first: an unpinned torch requirement would pull a CUDA build.
  "$VENV/bin/pip" install --progress-bar on "torch==2.13.0" 2>&1 | grep -v "^Requirement already satisfied" || true
  "$VENV/bin/pip" install --progress-bar on -e ".${extras:+[$extras]}" 2>&1 \
    | grep -E "^(Collecting|Successfully|ERROR)" || true
  "$VENV/bin/python" -c "import pagedkv" 2>/dev/null || { echo "run.sh: install failed" >&2; exit 1; }
  touch "$stamp"
  echo "run.sh: $VENV ready" >&2
fi
export PATH="$VENV/bin:$PATH"
case "$cmd" in
  setup) exit 0 ;;
  demo) cd "$caller_dir" && exec "$VENV/bin/pagedkv-demo" "$@" ;;
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
esac
