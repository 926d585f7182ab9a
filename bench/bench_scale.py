"""One block manager process under N schedulers that run in separate client processes, so the
server is what is measured (the old `bench_service.py --only scale` ran every scheduler in
one client process, which became the bottleneck first).

1. `step`: the Step RPC of one decode step for 256 sequences (every append sent, token ids,
   the previous step reported, lengths staggered so 1/16 cross a block per step) against this
   tree's block manager and against the `--before` revision's (extracted with `git archive`),
   with a same-size gRPC echo, all three servers up at once and called in turn (one call
   each per iteration): p50/p99, the ratios to the echo, and each server's CPU per Step (its
   process's user + system time over the measured calls, /proc; clock-tick resolution, so
   run a few hundred calls).
2. `scale`: N = 1, 4, 16, 64 schedulers (each its own pool, 256 running sequences,
   continuous batching through the async client's step helper: frees, admissions with a
   shared system prompt, one token per running sequence, every PoolStep reported as if its
   Forward ran at once), spread over `--procs` client processes (asyncio inside each); all
   processes start measuring at the same wall-clock instant. Reported: steps/s, Step RPCs/s,
   step latency p50/p99 (seen by the schedulers), and the server's CPU per Step RPC (from
   /proc, over the measured window) and its CPU use. The line says at which N the step p99
   first exceeds 10 ms.
3. `capacity` (issue 45): how many nodes one block manager process serves. Each simulated
   scheduler paces its Steps at `--rate` per second (a GPU node's decode step every ~33 ms),
   with a random phase so the nodes are not in lock-step; N grows along `--capacity-counts`
   until the step p99 passes 10 ms or the schedulers fall behind their pace (< 95% of the
   offered Steps/s). Run for every store in `--stores` (memory, sqlite: WAL, synchronous=FULL)
   and every batch in `--batches` (sequences per Step). Reported per N: offered and achieved
   Steps/s, p50/p99, server CPU per Step and its share of a core; per store and batch: the
   largest N that kept pace (= nodes served at `--rate` Steps/s each) and the Steps/s a whole
   core would give at the measured server CPU per Step (the bound once the clients are not
   sharing the machine).

    .venv/bin/python bench/bench_scale.py [--only step,scale,capacity] [--counts 1,4,16,64] [--seconds 10]
                                          [--procs 4] [--before bf0caa1] [--trees new,before]
                                          [--rate 30] [--capacity-counts 2,4,8,12,16,24,32]
                                          [--stores memory,sqlite] [--batches 64,256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_service as bs  # noqa: E402
import grpc  # noqa: E402

from block_manager.client import AsyncBlockManagerClient, BlockManagerClient  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402

DEFAULT_BEFORE = "bf0caa1"   # main before the array core (issue 20's "today")
P99_LIMIT_MS = 10.0


def extract(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


# ---- 1. Step vs echo, this tree vs before ------------------------------------------------------
def _setup_pool(c: BlockManagerClient, pool: str, n: int, iters: int) -> tuple[int, list[str]]:
    reg = c.register_node(pool, n * ((bs.BS + iters + 40) // bs.BS + 3) + 16, block_size=bs.BS)
    seq_ids = [f"{pool}-{i}" for i in range(n)]
    st = c.step()
    for i, sid in enumerate(seq_ids):   # staggered: 1/BS of them cross a block per step
        st.allocate(sid, pool, [i % 97] * (bs.BS + i % bs.BS))
    for info in st.commit().steps.values():
        c.report(info, True)
    c.flush_reports()
    return reg.epoch, seq_ids


def bench_step_ab(trees: dict[str, Path], n: int, iters: int) -> None:
    with ExitStack() as stack:
        servers = {name: stack.enter_context(bs.bm_server("memory://", tree=tree)) for name, tree in trees.items()}
        targets = {name: target for name, (target, _) in servers.items()}
        echo_target = stack.enter_context(bs.echo_server())
        echo = stack.enter_context(grpc.insecure_channel(echo_target)).unary_unary(bs.ECHO_METHOD)
        runs = {}
        for name, target in targets.items():
            c = stack.enter_context(BlockManagerClient(target, scheduler_id="bench"))
            stub = pb_grpc.BlockManagerStub(stack.enter_context(grpc.insecure_channel(target)))
            epoch, seq_ids = _setup_pool(c, "p", n, iters)
            runs[name] = {"stub": stub, "epoch": epoch, "seq_ids": seq_ids, "last": 0, "lat": [], "size": (0, 0),
                          "pid": servers[name][1].pid, "cpu": 0.0}
        echo_lat: list[float] = []
        for k in range(iters + 10):
            if k == 10:   # each server's CPU over the measured calls (its own process: gRPC's work included)
                for r in runs.values():
                    r["cpu"] = -bs._proc_cpu_s(r["pid"])
            for r in runs.values():
                req = bs._decode_step("p", r["epoch"], r["seq_ids"], k, r["last"])
                t0 = time.perf_counter()
                resp = r["stub"].Step(req, timeout=30)
                dt = time.perf_counter() - t0
                if resp.errors:
                    raise RuntimeError(f"step failed: {resp.errors[0]}")
                if resp.steps:
                    r["last"] = resp.steps[0].step_id
                r["size"] = (req.ByteSize(), resp.ByteSize())
                if k >= 10:
                    r["lat"].append(dt)
            req_size, resp_size = next(iter(runs.values()))["size"]
            t0 = time.perf_counter()
            echo(struct.pack("<I", resp_size) + b"\x00" * max(0, req_size - 4), timeout=30)
            if k >= 10:
                echo_lat.append(time.perf_counter() - t0)
        for r in runs.values():
            r["cpu"] += bs._proc_cpu_s(r["pid"])
        e50, e99 = 1e3 * percentile(echo_lat, 50), 1e3 * percentile(echo_lat, 99)
        print(f"step: {n} seqs x 1 token (every append sent), {iters} calls each, interleaved; "
              f"echo p50 {e50:.3f} p99 {e99:.3f} ms", flush=True)
        for name, r in runs.items():
            p50, p99 = 1e3 * percentile(r["lat"], 50), 1e3 * percentile(r["lat"], 99)
            print(f"  {name:8s} Step p50 {p50:.3f} p99 {p99:.3f} ms  ratio to echo {p50 / e50:.2f}  "
                  f"p99/p50 {p99 / p50:.1f}  server CPU {1e3 * r['cpu'] / iters:.2f} ms per Step", flush=True)


# ---- 2. scale ----------------------------------------------------------------------------------
async def _client_main(target: str, names: list[str], batch: int, start_at: float, seconds: float,
                       rate: float = 0.0) -> dict:
    """Closed loop (each scheduler steps as soon as its last Step answered) or, with `rate`,
    paced: each scheduler's k-th Step is due at start + phase + k / rate (a late Step is sent
    at once; the next stays on the grid), so the offered load is N x rate whatever the
    latency, as GPU nodes would offer it."""
    clients = [AsyncBlockManagerClient(target, timeout_s=120, scheduler_id=name) for name in names]
    sims = [bs.SimScheduler(c, name, batch, random.Random(name)) for c, name in zip(clients, names)]
    for sim in sims:
        await sim.register(bs.pool_blocks(batch))
    await asyncio.gather(*(sim.step() for sim in sims))   # admissions
    lat: list[float] = []
    rpcs0 = sum(c.stats.per_method.get("Step", 0) for c in clients)
    while time.time() < start_at:   # every process starts measuring at the same instant
        await asyncio.gather(*(sim.step() for sim in sims))
    end = start_at + seconds

    async def loop(sim: bs.SimScheduler) -> int:
        steps = 0
        phase = random.Random(sim.pool).random() / rate if rate else 0.0
        while time.time() < end:
            if rate:
                due = start_at + phase + steps / rate
                if due >= end:
                    break
                await asyncio.sleep(max(0.0, due - time.time()))
            t0 = time.perf_counter()
            await sim.step()
            lat.append(time.perf_counter() - t0)
            steps += 1
        return steps

    rpcs_start = sum(c.stats.per_method.get("Step", 0) for c in clients) - rpcs0
    steps = sum(await asyncio.gather(*(loop(s) for s in sims)))
    rpcs = sum(c.stats.per_method.get("Step", 0) for c in clients) - rpcs0 - rpcs_start
    for sim in sims:
        await sim.drain()
        await sim.client.release()
    for c in clients:
        await c.close()
    return {"steps": steps, "rpcs": rpcs, "lat": lat}


def run_client(args: argparse.Namespace) -> None:
    names = args.names.split(",")
    out = asyncio.run(_client_main(args.target, names, args.batch, args.start_at, args.seconds, args.rate))
    print(json.dumps(out))


@dataclass(slots=True)
class ScaleRun:
    steps: int
    rpcs: int
    lat: list[float]
    server_cpu_s: float
    wall_s: float
    num_procs: int
    num_late_procs: int


def run_schedulers(tree: Path, database_url: str, n: int, batch: int, seconds: float, procs: int,
                   rate: float = 0.0, **env: str) -> ScaleRun:
    """One block manager process and `n` schedulers spread over up to `procs` client processes;
    every process starts measuring at the same wall-clock instant."""
    with bs.bm_server(database_url, None, None, tree, **env) as (target, proc):
        num_procs = min(n, procs)
        groups = [[f"s{n}-{i}" for i in range(n) if i % num_procs == p] for p in range(num_procs)]
        setup_s = 20 + 0.5 * n * max(1, batch // 64)   # registration and admission before the common start
        start_at = time.time() + setup_s
        children = [
            subprocess.Popen(
                [sys.executable, __file__, "--client", target, "--names", ",".join(g), "--batch", str(batch),
                 "--start-at", repr(start_at), "--seconds", str(seconds), "--rate", str(rate)],
                stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            )
            for g in groups
        ]
        time.sleep(max(0.0, start_at - time.time()))
        cpu0, t0 = bs._proc_cpu_s(proc.pid), time.perf_counter()
        time.sleep(seconds)
        cpu, wall = bs._proc_cpu_s(proc.pid) - cpu0, time.perf_counter() - t0
        results = []
        for ch in children:
            stdout, _ = ch.communicate(timeout=600)
            if ch.returncode != 0:
                raise RuntimeError(f"client process failed ({ch.returncode})")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    return ScaleRun(
        steps=sum(r["steps"] for r in results), rpcs=sum(r["rpcs"] for r in results),
        lat=[x for r in results for x in r["lat"]], server_cpu_s=cpu, wall_s=wall, num_procs=num_procs,
        num_late_procs=sum(1 for r in results if not r["steps"]),
    )


def bench_scale(tree: Path, label: str, counts: list[int], batch: int, seconds: float, procs: int) -> None:
    crossed = None
    print(f"scale ({label}): {batch} running sequences per scheduler, {seconds:.0f} s per N, "
          f"schedulers spread over up to {procs} client processes", flush=True)
    for n in counts:
        run = run_schedulers(tree, "memory://", n, batch, seconds, procs)
        if run.num_late_procs:
            print(f"  N={n}: {run.num_late_procs} client processes were still admitting at the start; "
                  "raise setup time")
        p50, p99 = 1e3 * percentile(run.lat, 50), 1e3 * percentile(run.lat, 99)
        if crossed is None and p99 > P99_LIMIT_MS:
            crossed = n
        print(f"  N={n:3d} ({run.num_procs} procs): {run.steps / seconds:7.1f} steps/s "
              f"({run.rpcs / seconds:6.1f} Step RPCs/s) | step p50 {p50:6.2f} p99 {p99:6.2f} ms | server CPU "
              f"{1e3 * run.server_cpu_s / max(run.rpcs, 1):.2f} ms per Step RPC, "
              f"{100 * run.server_cpu_s / run.wall_s:.0f}% of a core", flush=True)
    print(f"  step p99 first above {P99_LIMIT_MS:.0f} ms at N = {crossed if crossed else 'none of ' + str(counts)}",
          flush=True)


STORES = {   # name -> (database URL under a temporary directory, server environment)
    "memory": (lambda tmp: "memory://", {}),
    "sqlite": (lambda tmp: f"sqlite:///{tmp / 'capacity.db'}", {"PAGEDKV_SQLITE_SYNCHRONOUS": "FULL"}),
}


def bench_capacity(tree: Path, stores: list[str], batches: list[int], counts: list[int], rate: float,
                   seconds: float, procs: int) -> None:
    print(f"capacity: schedulers paced at {rate:g} Steps/s each, {seconds:.0f} s per N; a level holds when "
          f"p99 <= {P99_LIMIT_MS:.0f} ms and >= 95% of the offered Steps/s were sent", flush=True)
    for store in stores:
        url_of, env = STORES[store]
        for batch in batches:
            held, cpu_ms = 0, []
            for n in counts:
                with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
                    run = run_schedulers(tree, url_of(Path(tmp)), n, batch, seconds, procs, rate, **env)
                p50, p99 = 1e3 * percentile(run.lat, 50), 1e3 * percentile(run.lat, 99)
                offered, achieved = n * rate, run.steps / seconds
                per_step = 1e3 * run.server_cpu_s / max(run.rpcs, 1)
                cpu_ms.append(per_step)
                ok = p99 <= P99_LIMIT_MS and achieved >= 0.95 * offered and not run.num_late_procs
                print(f"  {store:6s} batch {batch:3d} N={n:3d}: offered {offered:6.0f} achieved {achieved:6.1f} "
                      f"Steps/s | p50 {p50:6.2f} p99 {p99:7.2f} ms | server CPU {per_step:.2f} ms per Step, "
                      f"{100 * run.server_cpu_s / run.wall_s:3.0f}% of a core | {'holds' if ok else 'MISSES'}",
                      flush=True)
                if not ok:
                    break
                held = n
            best = min(cpu_ms) if cpu_ms else float("nan")
            print(f"  => {store} batch {batch}: {held} nodes at {rate:g} Steps/s each ({held * rate:.0f} Steps/s) "
                  f"kept p99 <= {P99_LIMIT_MS:.0f} ms here; server CPU {best:.2f} ms per Step bounds one core at "
                  f"{1e3 / best:.0f} Steps/s = {1e3 / best / rate:.0f} nodes", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="step,scale", help="step, scale, capacity (comma-separated)")
    ap.add_argument("--counts", default="1,4,16,64")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=300, help="Step calls per server in `step`")
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="revision to compare with ('' to skip)")
    ap.add_argument("--trees", default="new", help="which trees `scale` runs: new, before or both")
    ap.add_argument("--rate", type=float, default=30.0, help="capacity: Steps/s of each scheduler")
    ap.add_argument("--capacity-counts", default="2,4,8,12,16,24,32")
    ap.add_argument("--stores", default="memory,sqlite", help="capacity: memory, sqlite")
    ap.add_argument("--batches", default="64,256", help="capacity: sequences per Step")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--names", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        args.target = args.client
        run_client(args)
        return
    only = set(args.only.split(","))
    print(f"# bench_scale  python {sys.version.split()[0]}  grpc {grpc.__version__}  cpus {os.cpu_count()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-scale-before-") as tmp:
        trees = {"new": REPO}
        if args.before:
            trees["before"] = extract(args.before, Path(tmp))
        if "step" in only:
            bench_step_ab(trees, args.batch, args.iters)
        if "capacity" in only:
            bench_capacity(REPO, args.stores.split(","), [int(x) for x in args.batches.split(",")],
                           [int(x) for x in args.capacity_counts.split(",")], args.rate, args.seconds, args.procs)
        if "scale" in only:
            for name in args.trees.split(","):
                bench_scale(trees[name], name, [int(x) for x in args.counts.split(",")], args.batch, args.seconds,
                            args.procs)


if __name__ == "__main__":
    main()
