"""Prefill A/B across kernel versions (review §4.3 item 12; issue 43 item 1: "land the cheap
steps first so each is measured on its own").

Each version is a `kernels` package taken from a commit, timed in its own process (a fresh
import, its own JIT) on the same input: one layer of an 8k-token prompt, 32 query / 8 KV
heads x 128, fp16, block 16, kernel-only (`gpu_timing.time_call`). Versions are prepared on
the host before the GPU call, since the GPU host gets the working tree, not the history:

    .venv/bin/python bench/gpu_check_prefill_ab.py prepare e8e58de~1 e8e58de 5c1415e 12d5496
    # -> .prefill_ab/01-e8e58de~1/kernels, ... (git-ignored; pass ".prefill_ab" in `carry`)

gpu_check's `prefill_ab` phase then times every prepared version, then this tree, in the order
prepared (it does nothing when `.prefill_ab` is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
AB_DIR = REPO / ".prefill_ab"
TREE = "this tree"
MARK = "PREFILL_AB "  # prefix of the one result line the child prints


def label_for(index: int, commit: str) -> str:
    """A directory name for the index-th version (order kept by the prefix)."""
    return f"{index:02d}-" + re.sub(r"[^A-Za-z0-9._~^-]", "_", commit)


def prepare(commits: list[str], dest: Path = AB_DIR, repo: Path = REPO) -> list[Path]:
    """Extract `kernels/` of each commit into dest/NN-commit/ (replacing what was there)."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    exclude = repo / ".git" / "info" / "exclude"
    if exclude.parent.is_dir():
        entry = "/" + dest.relative_to(repo).as_posix() + "/" if dest.is_relative_to(repo) else None
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if entry and entry not in lines:
            exclude.write_text("\n".join([*lines, entry]) + "\n")
    out = []
    for i, commit in enumerate(commits, start=1):
        target = dest / label_for(i, commit)
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "kernels"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
        out.append(target)
    return out


def versions(dest: Path = AB_DIR) -> list[tuple[str, Path]]:
    """(label, directory holding `kernels/`) of every prepared version, then this tree."""
    found = sorted(p for p in dest.iterdir() if (p / "kernels").is_dir()) if dest.is_dir() else []
    return [(p.name, p) for p in found] + ([(TREE, REPO)] if found else [])


def time_version(kernels_root: Path, tokens: int, reps: int, smoke: bool) -> dict[str, Any]:
    """In the child: import `kernels` from `kernels_root`, time one prefill (module doc)."""
    sys.path.insert(0, str(kernels_root))
    if smoke:
        from gpu_check import use_stubbed_simulator

        use_stubbed_simulator()
    import torch
    from gpu_check_prefill import PrefillBench, causal_flops
    from gpu_sizes import FULL, SMOKE
    from gpu_timing import Timer

    import kernels

    origin = Path(kernels.__file__).resolve()
    if not origin.is_relative_to(kernels_root.resolve()):
        raise RuntimeError(f"kernels imported from {origin}, not {kernels_root}")
    device = "cpu" if smoke else "cuda"
    sizes = SMOKE if smoke else FULL
    bench = PrefillBench(torch, Timer(torch, device), device, sizes)
    x = bench.inputs(1, 0, tokens, "float16", sizes.head_dim)
    t0 = time.perf_counter()
    bench.paged(x, tokens, sizes.head_dim)  # the first call compiles
    first_s = time.perf_counter() - t0
    times = bench.paged(x, tokens, sizes.head_dim)
    flops = causal_flops(tokens, sizes.heads, sizes.head_dim)
    return {"tokens": tokens, "first_call_s": first_s, **times.as_row("paged_"),
            "tflops": flops / (times.kernel_us * 1e-6) / 1e12, "reps": reps}


def run_child(label: str, root: Path, tokens: int, timeout_s: float, smoke: bool) -> dict[str, Any]:
    """Time one version in a fresh interpreter; its result line, parsed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "time", "--kernels", str(root),
           "--tokens", str(tokens)] + (["--cpu-smoke"] if smoke else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the child decides (--cpu-smoke)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout_s),
                          env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{label}: exit {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}")
    return {"version": label, **json.loads(lines[-1][len(MARK):])}


def phase_prefill_ab(ctx: Any, tokens: int, smoke: bool, dest: Path = AB_DIR) -> None:
    found = versions(dest)
    if not found:
        ctx.record({"note": f"no versions prepared in {dest.name} (see bench/gpu_check_prefill_ab.py)"})
        return
    rows: list[dict[str, Any]] = []
    for label, root in found:
        def cell(label: str = label, root: Path = root) -> dict[str, Any]:
            row = run_child(label, root, tokens, ctx.clock.remaining(), smoke)
            rows.append(row)
            return row

        ctx.cell(label, cell)
    if rows and rows[0].get("paged_kernel_us"):
        first = rows[0]["paged_kernel_us"]
        ctx.record({"note": "speed vs the first version: " + ", ".join(
            f"{r['version']} {first / r['paged_kernel_us']:.2f}x" for r in rows)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="extract kernels/ of each commit into .prefill_ab/")
    prep.add_argument("commits", nargs="+")
    child = sub.add_parser("time", help="(internal) time one version in this process")
    child.add_argument("--kernels", type=Path, required=True)
    child.add_argument("--tokens", type=int, default=8192)
    child.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    if args.command == "prepare":
        for path in prepare(args.commits):
            print(path)
        return 0
    result = time_version(args.kernels, args.tokens, 10, args.cpu_smoke)
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
