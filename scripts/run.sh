#!/usr/bin/env bash
# One entry point for people and CI: sets up .venv (torch==2.13.0 first, then the
# project) if needed, then runs the main job (`demo`) or the whole test suite (`test`);
# `setup` only installs (the Dockerfile uses it, so images install exactly as people do).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PAGEDKV_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
stamp="$VENV/.pagedkv-installed"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/pip" install -q --upgrade pip
  # The CPU build of torch first: an unpinned torch requirement would pull a CUDA build.
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q -e ".[dev]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cmd=${1:-demo}
shift || true
case "$cmd" in
  setup) exit 0 ;;
  demo) exec "$VENV/bin/pagedkv-demo" "$@" ;;
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "usage: scripts/run.sh setup|demo|test [args...]" >&2; exit 2 ;;
esac
