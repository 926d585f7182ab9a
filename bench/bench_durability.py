"""Durable steps vs in-memory steps, this tree against a `--before` revision, in one run.

The same continuous-batching scheduler as `bench_service.py --only steps` (64 sequences per
client, every step one Step RPC with its admissions, frees and appends; 1 client, and 8
concurrent clients on their own pools): block managers on memory://, on SQLite
(WAL, synchronous=FULL, the default) from this tree, and on SQLite FULL from the `--before`
revision (extracted with `git archive`). All servers run at once and short rounds alternate
between them, so the machine's load drift hits all alike; medians per server, ratio to
memory:// of the same round set. With `--normal`, SQLite synchronous=NORMAL (no fsync per
commit) from this tree too: the difference FULL - NORMAL is the fsync, NORMAL - memory is
the journal's CPU.

    .venv/bin/python bench/bench_durability.py [--before 3578cf0] [--rounds 5] [--seconds 1.5] [--normal]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_service as bs  # noqa: E402
from bench_scale import extract  # noqa: E402

DEFAULT_BEFORE = "3578cf0"   # main before the durability work of issue 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=DEFAULT_BEFORE)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--normal", action="store_true", help="also SQLite synchronous=NORMAL (this tree)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-dur-"))
    (tmp / "before").mkdir()
    before = extract(args.before, tmp / "before")
    servers: list[tuple[str, str, Path, dict[str, str]]] = [
        ("memory://", "memory://", bs.REPO, {}),
        ("SQLite FULL (this tree)", f"sqlite:///{tmp / 'new.db'}", bs.REPO, {}),
        (f"SQLite FULL ({args.before})", f"sqlite:///{tmp / 'old.db'}", before, {}),
    ]
    if args.normal:
        normal = {"PAGEDKV_SQLITE_SYNCHRONOUS": "NORMAL"}
        servers.append(("SQLite NORMAL (this tree)", f"sqlite:///{tmp / 'normal.db'}", bs.REPO, normal))
    samples: dict[tuple[str, int], list[float]] = {(name, n): [] for name, *_ in servers for n in (1, 8)}
    print(f"# bench_durability  rounds {args.rounds} x {args.seconds:g}s  64 sequences per client", flush=True)
    with contextlib.ExitStack() as stack:
        targets = [
            (name, stack.enter_context(bs.bm_server(url, tree=tree, PAGEDKV_SNAPSHOT_INTERVAL_S="3600", **env))[0])
            for name, url, tree, env in servers
        ]
        for r in range(args.rounds):
            for n in (1, 8):
                for name, target in targets:
                    samples[(name, n)].append(asyncio.run(bs._async_steps(target, f"r{r}c{n}", n, 64, args.seconds)))
    base = {n: statistics.median(samples[(servers[0][0], n)]) for n in (1, 8)}
    print("| server | 1 client steps/s | vs memory | 8 clients steps/s | vs memory |")
    print("|---|---:|---:|---:|---:|")
    for name, *_ in servers:
        one, eight = (statistics.median(samples[(name, n)]) for n in (1, 8))
        print(f"| {name} | {one:.0f} | {one / base[1]:.2f}x | {eight:.0f} | {eight / base[8]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
