"""Durable steps vs in-memory steps, this tree against a `--before` revision, in one run.

The same continuous-batching scheduler as `bench_service.py --only steps` (64 sequences per
client, every step one Step RPC with its admissions, frees and appends; 1 client, and 8
concurrent clients on their own pools): block managers on memory://, on SQLite
(WAL, synchronous=FULL, the default) from this tree, and on SQLite FULL from the `--before`
revision (extracted with `git archive`). All servers run at once and short rounds alternate
between them, so the machine's load drift hits all alike; medians per server, ratio to
memory:// of the same round set; and each server's CPU per Step (from /proc, every thread,
over all rounds; the Step count is rate x wall time, setup included: indicative). With
`--normal`, SQLite synchronous=NORMAL (no fsync per commit) from this tree too: the
difference FULL - NORMAL is the fsync, NORMAL - memory is the journal's CPU.

`--pipeline`: instead, pipelined Steps (`ClientSession.after`, docs/durability.md "Pipelined
Steps") against one at a time, on memory:// and SQLite FULL of this tree: a decode-only
scheduler per client (64 sequences, one token each per Step with its id, reporting every
PoolStep answered so far) keeps `--depth` Steps in flight, each naming the one before it, or one
(depth 1, as the engine sends them today). Steps/s medians per server and depth, ratio to
memory:// at depth 1; 1 and 8 clients.

`--gil`: instead, the commit latency of SQLite FULL on a writer thread while another thread
of the same process runs Python without pause (the event loop under load), with the default
5 ms GIL switch interval and with the journal writer's `GIL_SWITCH_INTERVAL_S`, alternating,
each in a fresh process.

    .venv/bin/python bench/bench_durability.py [--before 3578cf0] [--rounds 5] [--seconds 1.5] [--normal]
    .venv/bin/python bench/bench_durability.py --pipeline [--depth 2] [--rounds 5] [--seconds 1.5]
    .venv/bin/python bench/bench_durability.py --gil
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_service as bs  # noqa: E402
from bench_scale import extract  # noqa: E402

DEFAULT_BEFORE = "3578cf0"   # main before the durability work of issue 20
BLOCK = 16


async def pipelined_steps(target: str, tag: str, num_clients: int, batch: int, seconds: float, depth: int) -> float:
    """Steps/s summed over `num_clients` decode-only schedulers keeping `depth` Steps in flight
    (each after the one before it in its session; depth 1: one at a time, no `after`)."""
    import grpc

    from pagedkv.v1 import block_manager_pb2 as pb
    from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

    async def one(idx: int) -> int:
        pool = f"{tag}-w{idx}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.BlockManagerStub(channel)
            reg = await stub.RegisterNode(pb.RegisterNodeRequest(
                request_id=f"{pool}-reg", node_id=pool, num_blocks=batch * (int(seconds * 4000) // BLOCK + 4),
                block_size=BLOCK, address="127.0.0.1:1",
                geometry=pb.KvGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", device="cpu")))
            sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name=pool))).session_id
            seq_ids = [f"{pool}-{i}" for i in range(batch)]
            lengths = [BLOCK + i % BLOCK for i in range(batch)]   # staggered: 1/16 cross a block per step
            alloc = pb.StepRequest(request_id=f"{pool}-0", scheduler_id=pool, alloc_seq_ids=seq_ids, pool_ids=[pool],
                                   alloc_pool_index=[0] * batch, alloc_salt_index=[-1] * batch,
                                   alloc_num_token_ids=lengths, alloc_num_tokens=[0] * batch,
                                   alloc_num_compute=[0] * batch)
            alloc.alloc_token_ids.extend(i % 97 for i, n in enumerate(lengths) for _ in range(n))
            alloc.session.session_id, alloc.session.seq = sid, 1
            done = (await stub.Step(alloc)).steps[0].step_id
            number, steps = 1, 0
            in_flight: deque[tuple[int, asyncio.Future[pb.StepResponse]]] = deque()
            end = time.perf_counter() + seconds
            while True:
                while len(in_flight) < depth and time.perf_counter() < end:
                    number += 1
                    req = pb.StepRequest(request_id=f"{pool}-{number}", scheduler_id=pool, append_seq_ids=seq_ids,
                                         append_num_tokens=[1] * batch, append_token_ids=[number % 1000] * batch)
                    req.reports.add(pool_id=pool, epoch=reg.epoch, completed_up_to=done)
                    s = req.session
                    s.session_id, s.seq, s.acked = sid, number, in_flight[0][0] if in_flight else number
                    s.after = number - 1 if depth > 1 else 0
                    in_flight.append((number, asyncio.ensure_future(stub.Step(req, timeout=30))))
                if not in_flight:
                    return steps
                _, call = in_flight.popleft()
                resp = await call
                if resp.errors:
                    raise RuntimeError(f"step failed: {resp.errors[0]}")
                if resp.steps:
                    done = max(done, resp.steps[0].step_id)
                steps += 1

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_clients)))
    return sum(counts) / (time.perf_counter() - t0)


def bench_pipeline(rounds: int, seconds: float, depth: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipe-"))
    servers = [("memory://", "memory://"), ("SQLite FULL", f"sqlite:///{tmp / 'full.db'}")]
    depths = (1, depth)
    samples: dict[tuple[str, int, int], list[float]] = {}
    print(f"# bench_durability --pipeline  rounds {rounds} x {seconds:g}s  64 sequences per client, depth {depth}",
          flush=True)
    with contextlib.ExitStack() as stack:
        targets = [(name, stack.enter_context(bs.bm_server(url, PAGEDKV_SNAPSHOT_INTERVAL_S="3600"))[0])
                   for name, url in servers]
        for r in range(rounds):
            for n in (1, 8):
                for d in depths:
                    for name, target in targets:
                        rate = asyncio.run(pipelined_steps(target, f"r{r}c{n}d{d}", n, 64, seconds, d))
                        samples.setdefault((name, n, d), []).append(rate)
    base = {n: statistics.median(samples[("memory://", n, 1)]) for n in (1, 8)}
    print("| server | in flight | 1 client steps/s | vs memory depth 1 | 8 clients steps/s | vs memory depth 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _ in servers:
        for d in depths:
            one, eight = (statistics.median(samples[(name, n, d)]) for n in (1, 8))
            print(f"| {name} | {d} | {one:.0f} | {one / base[1]:.2f}x | {eight:.0f} | {eight / base[8]:.2f}x |",
                  flush=True)


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
    p.add_argument("--pipeline", action="store_true", help="pipelined Steps vs one at a time instead")
    p.add_argument("--depth", type=int, default=2, help="--pipeline: Steps in flight per client")
    p.add_argument("--gil-probe", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gil_probe is not None:
        gil_probe(args.gil_probe)
        return
    if args.gil:
        bench_gil(args.rounds)
        return
    if args.pipeline:
        bench_pipeline(args.rounds, args.seconds, args.depth)
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
    cpu: dict[str, list[float]] = {name: [0.0, 0.0] for name, *_ in servers}   # server CPU-s, Steps
    print(f"# bench_durability  rounds {args.rounds} x {args.seconds:g}s  64 sequences per client", flush=True)
    with contextlib.ExitStack() as stack:
        targets = [
            (name, *stack.enter_context(bs.bm_server(url, tree=tree, PAGEDKV_SNAPSHOT_INTERVAL_S="3600", **env)))
            for name, url, tree, env in servers
        ]
        for r in range(args.rounds):
            for n in (1, 8):
                for name, target, proc in targets:
                    cpu0, t0 = _cpu_s(proc.pid), time.perf_counter()
                    rate = asyncio.run(bs._async_steps(target, f"r{r}c{n}", n, 64, args.seconds))
                    cpu[name][0] += _cpu_s(proc.pid) - cpu0
                    cpu[name][1] += rate * (time.perf_counter() - t0)   # Steps, about (setup included)
                    samples[(name, n)].append(rate)
    base = {n: statistics.median(samples[(servers[0][0], n)]) for n in (1, 8)}
    print("| server | 1 client steps/s | vs memory | 8 clients steps/s | vs memory | server CPU ms/Step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, *_ in servers:
        one, eight = (statistics.median(samples[(name, n)]) for n in (1, 8))
        ms = 1e3 * cpu[name][0] / max(cpu[name][1], 1.0)
        print(f"| {name} | {one:.0f} | {one / base[1]:.2f}x | {eight:.0f} | {eight / base[8]:.2f}x | {ms:.2f} |",
              flush=True)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, every thread (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
