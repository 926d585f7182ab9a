"""Micro-benchmark of the block manager core, in-process.

Prints the latency of one decode step's batched append for N sequences (1 token each, with
token ids so full blocks get hashed), p50/p99 in µs over many steps, and allocate/free
throughput. Numbers only; nothing is asserted.

Append APIs compared in one run (each in a fresh interpreter, interleaved rounds):
  * `columns`   — `append_tokens`, the columnar path the Step RPC uses;
  * `slots`     — `append_slots`, one request object in and one result object out per sequence;
  * `baseline`  — `append_slots` of an older revision (`--baseline REV`, default the commit
                  before the step protocol), extracted with `git archive` into a temp dir;
  * `before-columns` / `before-slots` — the same two APIs of the core before the array
                  columns (`--before REV`, default bf0caa1, issue 20's "today").
The new core also closes and settles the step each iteration (what a Forward cycle costs the
block manager); that is timed separately.

Sequences start at staggered prompt lengths (as in a running batch, so about 1/block_size
of them cross a block boundary per step); `--aligned` makes every sequence cross at the
same step, the worst case. Wall time includes being descheduled on a shared machine; CPU
time (process CPU clock) does not, so both are printed.

    .venv/bin/python bench/bench_core.py [--seqs 256] [--steps 2000] [--block-size 16] [--aligned]
                                         [--baseline 4395670] [--before bf0caa1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "4395670"   # main before the step protocol (issue 9's "today")
DEFAULT_BEFORE = "bf0caa1"     # main before the array columns (issue 20's "today")


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (kept local: the child also runs against old trees)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))]


def child(api: str, num_seqs: int, num_steps: int, block_size: int, prompt_len: int, aligned: bool) -> None:
    """Run in a fresh interpreter against whatever `block_manager` is on sys.path; prints
    JSON: per-step wall and CPU seconds of the append (and of close+settle when it exists)."""
    from block_manager.core import AppendRequest, BlockManager

    blocks_per_seq = (prompt_len + block_size + num_steps) // block_size + 2
    m = BlockManager(watermark=0.0)
    m.add_pool("p", num_seqs * blocks_per_seq, block_size)
    for i in range(num_seqs):
        length = prompt_len if aligned else prompt_len + i % block_size
        m.allocate(f"s{i}", "p", [i] * length)
    seq_ids = [f"s{i}" for i in range(num_seqs)]
    ones = [1] * num_seqs
    steps = hasattr(m, "close_step")
    wall, cpu, cycle = [], [], []
    for step in range(num_steps):
        if steps:
            t0 = time.process_time()
            out = m.close_step("p")
            if out is not None:
                m.settle_steps("p", out.step_id)
            cycle.append(time.process_time() - t0)
        if api == "columns":
            toks = array("q", [step]) * num_seqs
            c0 = time.process_time()
            t0 = time.perf_counter()
            m.append_tokens(seq_ids, ones, toks)
        else:
            batch = [AppendRequest(sid, 1, (step,)) for sid in seq_ids]
            c0 = time.process_time()
            t0 = time.perf_counter()
            m.append_slots(batch)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if m.fsck():
        raise SystemExit("fsck failed after the benchmark")
    print(json.dumps({"wall": wall, "cpu": cpu, "cycle": cycle}))


def _run_child(api: str, tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", api, "--seqs", str(args.seqs),
            "--steps", str(args.steps), "--block-size", str(args.block_size), "--prompt-len", str(args.prompt_len)]
    if args.aligned:
        argv.append("--aligned")
    out = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_alloc_free(num_rounds: int, block_size: int, prompt_len: int) -> tuple[float, float]:
    from block_manager.core import BlockManager

    m = BlockManager(watermark=0.0, enable_prefix_caching=False)
    m.add_pool("p", 4096, block_size)
    ids = [f"r{i}" for i in range(64)]
    t_alloc = t_free = 0.0
    for _ in range(num_rounds):
        t0 = time.perf_counter()
        for sid in ids:
            m.allocate(sid, "p", num_tokens=prompt_len)
        t1 = time.perf_counter()
        out = m.close_step("p")   # the allocations' writes ran (a scheduler frees after its Forward)
        if out is not None:
            m.settle_steps("p", out.step_id)
        t2 = time.perf_counter()
        m.free(ids)
        t3 = time.perf_counter()
        t_alloc += t1 - t0
        t_free += t3 - t2
    n = num_rounds * len(ids)
    return n / t_alloc, n / t_free


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--aligned", action="store_true", help="all sequences cross blocks together")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision to compare with ('' to skip)")
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="second revision to compare with ('' to skip)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per API (median reported)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.seqs, args.steps, args.block_size, args.prompt_len, args.aligned)
        return
    trees: dict[str, tuple[str, Path]] = {"columns": ("columns", REPO), "slots": ("slots", REPO)}
    tmps = []
    for label, rev, apis in (("before", args.before, ("columns", "slots")), ("baseline", args.baseline, ("slots",))):
        if not rev:
            continue
        tmp = tempfile.TemporaryDirectory(prefix=f"bench-core-{label}-")
        tmps.append(tmp)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "block_manager", "pagedkv"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
        for api in apis:
            trees[label if label == "baseline" else f"{label}-{api}"] = (api, Path(tmp.name))
    layout = "aligned" if args.aligned else "staggered"
    print(f"append for {args.seqs} sequences x 1 token, block_size {args.block_size}, {layout}, "
          f"{args.steps} steps x {args.rounds} rounds (median of the rounds' p50/p99; CPU time)")
    p50: dict[str, list[float]] = {name: [] for name in trees}
    p99: dict[str, list[float]] = {name: [] for name in trees}
    cycle: list[float] = []
    for _ in range(args.rounds):
        for name, (api, tree) in trees.items():
            res = _run_child(api, tree, args)
            us = [t * 1e6 for t in res["cpu"][len(res["cpu"]) // 10 :]]   # drop warm-up
            p50[name].append(_pct(us, 50))
            p99[name].append(_pct(us, 99))
            if res["cycle"] and name == "columns":
                cycle.append(_pct([t * 1e6 for t in res["cycle"][len(res["cycle"]) // 10 :]], 50))
    base = statistics.median(p50["baseline"]) if "baseline" in p50 else None
    for name in trees:
        m50, m99 = statistics.median(p50[name]), statistics.median(p99[name])
        ratio = f"  {base / m50:.2f}x faster than baseline {args.baseline}" if base and name != "baseline" else ""
        print(f"  {name:14s} p50 {m50:7.1f} µs  p99 {m99:7.1f} µs{ratio}")
    if cycle:
        print(f"  close_step + settle_steps per step (new core): p50 {statistics.median(cycle):.1f} µs")
    sys.path.insert(0, str(REPO))
    a_rate, f_rate = bench_alloc_free(200, args.block_size, 512)
    print(f"allocate (512-token prompt, no hashing): {a_rate:,.0f} seq/s; free: {f_rate:,.0f} seq/s")
    for tmp in tmps:
        tmp.cleanup()


if __name__ == "__main__":
    main()
