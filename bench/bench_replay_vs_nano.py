"""Whole-process trace replay: pagedkv's `block-manager replay` against nano-vllm's
`BlockManager` on the same generated trace, side by side (issue 45).

    git clone https://github.com/GeeeekExplorer/nano-vllm /path/nano-vllm
    .venv/bin/python bench/bench_replay_vs_nano.py --nano-vllm /path/nano-vllm \
        [--requests 2000] [--max-running 256] [--num-blocks 20000] [--block-size 16] [--repeats 3]

The trace is `block_manager.trace.generate`'s chat mix (half the prompts start with one of four
256-token system prompts, loguniform prompt and output lengths), one tenant and no parallel
samples (nano-vllm has neither salts nor forks). Each side is its own process, started,
timed to its exit by this script, sides alternating; nano-vllm's side is `nano_replay.py`
(how each op maps to its block manager is there). Per side: the whole process (interpreter,
imports, reading the trace, the replay), the replay alone as the side reports it, and the
prefix-cache hit tokens, which must agree (the same trace, the same block size, both caching
full blocks by a chained hash). Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_side(cmd: list[str]) -> tuple[float, dict]:
    """(the process's wall seconds from start to exit, the JSON object it printed last)."""
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(ours: list[tuple[float, dict]], nano: list[tuple[float, dict]]) -> dict[str, float]:
    """Medians; `speed` = nano-vllm's whole-process time ÷ ours (> 1: ours faster). Refuses
    runs whose prefix hits disagree: the two sides would not have replayed the same work."""
    hits = {r["prefix_hit_tokens"] for _, r in ours} | {r["prefix_hit_tokens"] for _, r in nano}
    if len(hits) != 1:
        raise ValueError(f"the sides disagree on prefix-cache hit tokens: {sorted(hits)}")
    ours_wall = statistics.median(w for w, _ in ours)
    nano_wall = statistics.median(w for w, _ in nano)
    return {
        "ours_process_s": ours_wall,
        "nano_process_s": nano_wall,
        "ours_replay_s": statistics.median(r["wall_s"] for _, r in ours),
        "ours_core_s": statistics.median(r["core_s"] for _, r in ours),
        "nano_replay_s": statistics.median(r["replay_s"] for _, r in nano),
        "speed": nano_wall / ours_wall,
        "prefix_hit_tokens": hits.pop(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nano-vllm", required=True, type=Path, help="a checkout of nano-vllm")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=20_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    from block_manager.trace.generate import TraceConfig, write_trace

    geometry = ["--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size)]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        num_ops = write_trace(trace, TraceConfig(num_requests=args.requests, seed=args.seed,
                                                 max_running=args.max_running))
        ours_cmd = [sys.executable, "-m", "block_manager.cli.main", "replay", str(trace), *geometry]
        nano_cmd = [sys.executable, str(REPO / "bench" / "nano_replay.py"), str(args.nano_vllm), str(trace), *geometry]
        runs: dict[str, list[tuple[float, dict]]] = {"ours": [], "nano": []}
        for r in range(args.repeats):
            for side in (["ours", "nano"] if r % 2 == 0 else ["nano", "ours"]):
                runs[side].append(run_side(ours_cmd if side == "ours" else nano_cmd))
        s = summarize(runs["ours"], runs["nano"])
    print(f"# replay vs nano-vllm, {time.strftime('%Y-%m-%d %H:%M')}: {args.requests} requests ({num_ops} ops), "
          f"{args.max_running} running, {args.num_blocks} blocks of {args.block_size}, repeats {args.repeats}")
    print("| side | whole process s | replay s | core s | prefix hit tokens |")
    print("|---|---|---|---|---|")
    print(f"| pagedkv `block-manager replay` | {s['ours_process_s']:.2f} | {s['ours_replay_s']:.2f} | "
          f"{s['ours_core_s']:.2f} | {s['prefix_hit_tokens']} |")
    print(f"| nano-vllm `BlockManager` | {s['nano_process_s']:.2f} | {s['nano_replay_s']:.2f} | - | "
          f"{s['prefix_hit_tokens']} |")
    print(f"pagedkv ÷ nano-vllm speed (whole process): {s['speed']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
