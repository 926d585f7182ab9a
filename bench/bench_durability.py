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

`--gil`: instead, the commit latency of SQLite FULL on a writer thread while another thread
of the same process runs Python without pause (the event loop under load), with the default
5 ms GIL switch interval and with the journal writer's `GIL_SWITCH_INTERVAL_S`, alternating,
each in a fresh process.

    .venv/bin/python bench/bench_durability.py [--before 3578cf0] [--rounds 5] [--seconds 1.5] [--normal]
    .venv/bin/python bench/bench_durability.py --gil
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_service as bs  # noqa: E402
from bench_scale import extract  # noqa: E402

DEFAULT_BEFORE = "3578cf0"   # main before the durability work of issue 20


def gil_probe(switch_interval_s: float, num_commits: int = 300) -> None:
    """One line: SQLite FULL commits on this thread while a second thread spins in Python."""
    import sqlite3

    sys.setswitchinterval(switch_interval_s)
    db = Path(tempfile.mkdtemp(prefix="bench-gil-")) / "gil.db"
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE journal (seq_no INTEGER PRIMARY KEY, payload TEXT)")
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    spinner = threading.Thread(target=busy)
    spinner.start()
    lat = []
    for i in range(num_commits):
        t0 = time.perf_counter()
        conn.execute("BEGIN")
        conn.execute("INSERT INTO journal VALUES (?, ?)", (i, "x" * 3200))
        conn.execute("COMMIT")
        lat.append(time.perf_counter() - t0)
    stop.set()
    spinner.join()
    lat.sort()
    print(
        f"| {switch_interval_s * 1e3:.1f} ms | {statistics.mean(lat) * 1e3:.2f} | {lat[len(lat) // 2] * 1e3:.2f} "
        f"| {lat[int(len(lat) * 0.9)] * 1e3:.2f} |",
        flush=True,
    )


def bench_gil(rounds: int) -> None:
    from block_manager.service.journal_writer import GIL_SWITCH_INTERVAL_S

    print("| GIL switch interval | commit mean ms | p50 ms | p90 ms |")
    print("|---|---:|---:|---:|")
    for _ in range(rounds):
        for si in (0.005, GIL_SWITCH_INTERVAL_S):
            subprocess.run([sys.executable, __file__, "--gil-probe", str(si)], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=DEFAULT_BEFORE)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--normal", action="store_true", help="also SQLite synchronous=NORMAL (this tree)")
    p.add_argument("--gil", action="store_true", help="the GIL switch interval probe instead")
    p.add_argument("--gil-probe", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gil_probe is not None:
        gil_probe(args.gil_probe)
        return
    if args.gil:
        bench_gil(args.rounds)
        return
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
