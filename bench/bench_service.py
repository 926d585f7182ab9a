"""Block manager service benchmarks, client and servers in separate processes.

1. `step`: the Step RPC of one decode step for 1/16/64/256/512 sequences (one token each,
   with token ids, the previous step reported; lengths staggered so 1/16 cross a block per
   step), p50/p99, next to a bare gRPC echo (generic handler, raw bytes) with the same request
   and response sizes, measured in the same run; ratio = Step p50 / echo p50.
2. `steps`: decode steps/s of a continuous-batching scheduler (the client's step helper, every
   step's appends sent to the server, 64 sequences) against memory://, SQLite (WAL) with
   synchronous=NORMAL and =FULL, and PostgreSQL (throwaway cluster, fsync=on), with 1 client
   and with 8 concurrent clients (group commit); ratio to memory:// in the same round.
3. `recovery`: 100k blocks in use; SIGKILL the server, restart, time until health SERVING
   (journal replay only, and from the final snapshot after a graceful stop).
4. `rpt`: RPCs per generated token of a continuous-batching decode workload through the step
   helper, with and without deferred in-block appends.
5. `scale`: one block manager process serving N = 1, 4, 16 simulated node schedulers (each
   its own pool, 256 running sequences, continuous batching through the step helper, every
   step reported as if its Forward ran): sustained steps/s, p50/p99 step latency, server CPU
   per step.
6. `tls`: the Step RPC of one decode step (1/64/256 sequences) against three block managers
   running at once — plaintext without auth, plaintext with bearer-token auth, mutual TLS with
   identities from certificates (dev CA from scripts/gen-dev-certs.sh) — interleaved call by
   call, p50/p99 and the ratio to plaintext; plus Route of 10^6 token ids with the old limit
   (accepted) and the default `max_route_tokens` (refused), and of 131072 (accepted).

    .venv/bin/python bench/bench_service.py [--only step,steps,recovery,rpt,scale,tls] [--no-postgres] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from block_manager.client import AdminClient, AsyncBlockManagerClient, BlockManagerClient, RetryPolicy  # noqa: E402
from demo.localstack import ServiceProcess  # noqa: E402
from pagedkv.lifecycle import write_port_file  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
from pagedkv.tls import TlsSettings, open_channel  # noqa: E402
from pagedkv.v1 import block_manager_pb2 as pb  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402

BS = 16
ECHO_METHOD = "/bench.Echo/Echo"


# ---- processes ------------------------------------------------------------------------
def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    env.update(
        PAGEDKV_BLOCK_SIZE=str(BS), PAGEDKV_WATERMARK="0", PAGEDKV_LOG_LEVEL="WARNING", PAGEDKV_DEFRAG__ENABLED="false",
        PAGEDKV_SHUTDOWN_GRACE_S="1", PAGEDKV_LEASE_TTL_S="3600",
    )
    env.update(extra)
    return env


def wait_serving(target: str, timeout_s: float = 120.0, tls: TlsSettings | None = None) -> None:
    """Block on the health service's Watch stream until SERVING (no polling)."""
    with open_channel(target, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                for msg in stub.Watch(
                    health_pb2.HealthCheckRequest(service=""),
                    timeout=max(0.1, deadline - time.monotonic()),
                    wait_for_ready=True,
                ):
                    if msg.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)  # the listener restarted between Watch attempts


@contextmanager
def bm_server(
    database_url: str, log_file: Path | None = None, tls: TlsSettings | None = None, tree: Path = REPO, **env: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A block manager process; `tree` is the source tree it runs (another revision's, for A/B)."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-bm-")) if log_file is None else log_file.parent
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url"]
    name = log_file.stem if log_file else "bm"
    env = server_env(**env)
    if tree != REPO:
        env["PYTHONPATH"] = str(tree)
    with ServiceProcess.start([*argv, database_url], workdir=workdir, name=name, env=env, cwd=tree) as server:
        wait_serving(server.address, tls=tls)
        yield server.address, server.proc


@contextmanager
def echo_server() -> Iterator[str]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-echo-"))
    with ServiceProcess.start([sys.executable, __file__, "--echo-server"], workdir=workdir, name="echo", cwd=REPO) as s:
        with grpc.insecure_channel(s.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        yield s.address


def run_echo_server(port_file: Path) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        (size,) = struct.unpack_from("<I", request)
        return b"\x01" * size

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            return grpc.unary_unary_rpc_method_handler(echo) if details.method == ECHO_METHOD else None

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        write_port_file(port_file, port)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0)

    asyncio.run(main())


# ---- a scheduler that drives one pool through the step helper -------------------------------
class SimScheduler:
    """Continuous batching over one pool with the real async client: each step frees the
    finished sequences, admits new ones (prompts with a shared system prompt: prefix hits),
    appends one token to every running sequence and commits ONE step; every PoolStep the
    server returns is reported done with the next step, as if its Forward ran at once."""

    def __init__(self, client: AsyncBlockManagerClient, pool: str, batch: int, rng: random.Random,
                 *, defer: bool = True) -> None:
        self.client, self.pool, self.batch, self.rng = client, pool, batch, rng
        self.live: dict[str, int] = {}     # seq -> tokens still to generate
        self.next_id = 0
        self.generated = 0
        self.system = [rng.randrange(32000) for _ in range(64)]
        self.defer = defer

    async def register(self, num_blocks: int) -> None:
        await self.client.register_node(self.pool, num_blocks, block_size=BS)
        if not self.defer:   # (registering taught the tracker the block size)
            self.client.tracker.block_sizes.clear()   # the helper cannot answer appends locally

    async def step(self) -> None:
        rng = self.rng
        step = self.client.step()
        done = [s for s, left in self.live.items() if left == 0]
        if done:
            step.free(done)
            for s in done:
                del self.live[s]
        admitted = []
        while len(self.live) + len(admitted) < self.batch:
            sid = f"{self.pool}-{self.next_id}"
            self.next_id += 1
            prompt = self.system + [rng.randrange(32000) for _ in range(rng.randint(16, 200))]
            step.allocate(sid, self.pool, prompt)
            admitted.append(sid)
        for sid in self.live:
            step.append(sid, [rng.randrange(32000)])
        res = await step.commit()
        if res.failures:
            raise RuntimeError(f"step failed: {res.failures[0]}")
        for sid in self.live:
            self.live[sid] -= 1
            self.generated += 1
        for sid in admitted:
            self.live[sid] = rng.randint(32, 256)
        for info in res.steps.values():
            self.client.report(info, True)

    async def drain(self) -> None:
        if self.live:
            await self.client.free(list(self.live))
            self.live.clear()


def pool_blocks(batch: int) -> int:
    return batch * ((64 + 200 + 256) // BS + 2) + 64


# ---- 1. Step vs echo ------------------------------------------------------------------------
def _decode_step(pool: str, epoch: int, seq_ids: list[str], k: int, report_up_to: int) -> pb.StepRequest:
    m = pb.StepRequest(request_id=f"{pool}-{k}", scheduler_id="bench")
    if report_up_to:
        m.reports.add(pool_id=pool, epoch=epoch, completed_up_to=report_up_to)
    m.append_seq_ids.extend(seq_ids)
    m.append_num_tokens.extend([1] * len(seq_ids))
    m.append_token_ids.extend([7 + k % 1000] * len(seq_ids))
    return m


def bench_step(sizes: list[int], iters: int) -> list[dict[str, float]]:
    rows = []
    with bm_server("memory://") as (target, _), echo_server() as echo_target:
        with BlockManagerClient(target, scheduler_id="bench") as c, grpc.insecure_channel(echo_target) as ech, \
                grpc.insecure_channel(target) as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            echo = ech.unary_unary(ECHO_METHOD)
            for n in sizes:
                pool = f"node{n}"
                reg = c.register_node(pool, n * ((BS + iters + 40) // BS + 3) + 16, block_size=BS)
                seq_ids = [f"n{n}-{i}" for i in range(n)]
                for lo in range(0, n, 256):
                    st = c.step()
                    for i in range(lo, min(n, lo + 256)):   # staggered: 1/BS of them cross per step
                        st.allocate(seq_ids[i], pool, [i % 97] * (BS + i % BS))
                    res = st.commit()
                    for info in res.steps.values():
                        c.report(info, True)
                c.flush_reports()
                last = 0
                bm_lat, echo_lat = [], []
                req_size = resp_size = 0
                for k in range(iters + 10):
                    req = _decode_step(pool, reg.epoch, seq_ids, k, last)
                    t0 = time.perf_counter()
                    resp = stub.Step(req, timeout=30)
                    dt = time.perf_counter() - t0
                    if resp.errors:
                        raise RuntimeError(f"step failed: {resp.errors[0]}")
                    if resp.steps:
                        last = resp.steps[0].step_id
                    req_size, resp_size = req.ByteSize(), resp.ByteSize()
                    payload = struct.pack("<I", resp_size) + b"\x00" * max(0, req_size - 4)
                    t0 = time.perf_counter()
                    echo(payload, timeout=30)
                    de = time.perf_counter() - t0
                    if k >= 10:  # warm-up
                        bm_lat.append(dt)
                        echo_lat.append(de)
                row = {
                    "mode": "every append sent", "seqs": n, "req_bytes": req_size, "resp_bytes": resp_size,
                    "bm_p50_ms": 1e3 * percentile(bm_lat, 50), "bm_p99_ms": 1e3 * percentile(bm_lat, 99),
                    "echo_p50_ms": 1e3 * percentile(echo_lat, 50), "echo_p99_ms": 1e3 * percentile(echo_lat, 99),
                }
                row["ratio_p50"] = row["bm_p50_ms"] / row["echo_p50_ms"]
                rows.append(row)
                print(
                    f"step (every append sent) {n:4d} seqs  req {req_size:6d}B resp {resp_size:6d}B  "
                    f"Step p50 {row['bm_p50_ms']:.3f} "
                    f"p99 {row['bm_p99_ms']:.3f} ms (p99/p50 {row['bm_p99_ms'] / row['bm_p50_ms']:.1f}) | echo p50 "
                    f"{row['echo_p50_ms']:.3f} p99 {row['echo_p99_ms']:.3f} ms | ratio {row['ratio_p50']:.2f}",
                    flush=True,
                )
            for n in sizes:
                rows.append(_helper_steps(c, stub, echo, n, iters))
    return rows


def _helper_steps(c: BlockManagerClient, stub: pb_grpc.BlockManagerStub, echo: object, n: int, iters: int) -> dict:
    """What the step helper actually sends for `n` running sequences decoding one token each:
    in-block appends are answered locally, so the Step RPC carries the sequences that cross a
    block (1/16 per step, staggered) with their deferred tokens; timed next to a same-size echo."""
    pool = f"helper{n}"
    c.register_node(pool, n * ((BS + iters + 40) // BS + 3) + 16, block_size=BS)
    seq_ids = [f"h{n}-{i}" for i in range(n)]
    st = c.step()
    for i, sid in enumerate(seq_ids):
        st.allocate(sid, pool, [i % 97] * (BS + i % BS))
    for info in st.commit().steps.values():
        c.report(info, True)
    bm_lat, echo_lat, items = [], [], []
    req_size = resp_size = 0
    for k in range(iters + 10):
        st = c.step()
        for sid in seq_ids:
            st.append(sid, [7 + k % 1000])
        req = c._begin(st, f"{pool}-{k}")
        if req is None:
            continue
        t0 = time.perf_counter()
        resp = stub.Step(req, timeout=30)
        dt = time.perf_counter() - t0
        c._sent(req, resp)
        res = st.apply(resp)
        if res.failures:
            raise RuntimeError(f"step failed: {res.failures[0]}")
        for info in res.steps.values():
            c.report(info, True)
        req_size, resp_size = req.ByteSize(), resp.ByteSize()
        t0 = time.perf_counter()
        echo(struct.pack("<I", resp_size) + b"\x00" * max(0, req_size - 4), timeout=30)  # type: ignore[operator]
        de = time.perf_counter() - t0
        if k >= 10:
            bm_lat.append(dt)
            echo_lat.append(de)
            items.append(len(req.append_seq_ids))
    row = {"mode": "step helper (deferred in-block appends)", "seqs": n, "req_bytes": req_size,
           "resp_bytes": resp_size, "bm_p50_ms": 1e3 * percentile(bm_lat, 50),
           "bm_p99_ms": 1e3 * percentile(bm_lat, 99), "echo_p50_ms": 1e3 * percentile(echo_lat, 50),
           "echo_p99_ms": 1e3 * percentile(echo_lat, 99), "appends_per_rpc": statistics.fmean(items)}
    row["ratio_p50"] = row["bm_p50_ms"] / row["echo_p50_ms"]
    print(f"step (step helper)        {n:4d} seqs  {row['appends_per_rpc']:5.1f} appends/RPC  Step p50 "
          f"{row['bm_p50_ms']:.3f} p99 {row['bm_p99_ms']:.3f} ms (p99/p50 {row['bm_p99_ms'] / row['bm_p50_ms']:.1f})"
          f" | echo p50 {row['echo_p50_ms']:.3f} ms | ratio {row['ratio_p50']:.2f}", flush=True)
    return row


# ---- 2. steps/s per backend ----------------------------------------------------------------
async def _async_steps(target: str, tag: str, num_clients: int, batch: int, seconds: float) -> float:
    """Steps/s summed over `num_clients` concurrent schedulers, each with its own pool (fresh
    per round); every append goes to the server (no local answers) so each step is one RPC."""

    async def one(idx: int) -> int:
        pool = f"{tag}-w{idx}"
        async with AsyncBlockManagerClient(target, retry=RetryPolicy(max_attempts=1), scheduler_id=pool) as c:
            sim = SimScheduler(c, pool, batch, random.Random(idx), defer=False)
            await sim.register(pool_blocks(batch) * 4)
            await sim.step()   # admission
            steps = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                await sim.step()
                steps += 1
            await sim.drain()
            await c.release()
            return steps

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_clients)))
    return sum(counts) / (time.perf_counter() - t0)


def bench_steps(with_postgres: bool, seconds: float, rounds: int) -> list[dict[str, object]]:
    """All backends' servers run at once; short rounds alternate between them and the
    median per backend is reported, so load drift from other processes hits all alike."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-svc-"))
    backends: list[tuple[str, str, dict[str, str]]] = [
        ("memory", "memory://", {}),
        ("sqlite (WAL, NORMAL)", f"sqlite:///{tmp / 'normal.db'}", {"PAGEDKV_SQLITE_SYNCHRONOUS": "NORMAL"}),
        ("sqlite (WAL, FULL)", f"sqlite:///{tmp / 'full.db'}", {"PAGEDKV_SQLITE_SYNCHRONOUS": "FULL"}),
    ]
    cluster = None
    if with_postgres:
        from tests.fixtures.postgres import PostgresCluster

        cluster = PostgresCluster()
        cluster.start()
        backends.append(("postgresql (fsync=on)", cluster.create_database(), {}))
    samples: dict[tuple[str, int], list[float]] = {(name, n): [] for name, _, _ in backends for n in (1, 8)}
    try:
        with contextlib.ExitStack() as stack:
            targets = [
                (name, stack.enter_context(bm_server(url, PAGEDKV_SNAPSHOT_INTERVAL_S="3600", **env))[0])
                for name, url, env in backends
            ]
            for r in range(rounds):
                for name, target in targets:
                    for n in (1, 8):
                        samples[(name, n)].append(asyncio.run(_async_steps(target, f"r{r}c{n}", n, 64, seconds)))
    finally:
        if cluster is not None:
            cluster.stop()
    rows: list[dict[str, object]] = []
    base = {n: statistics.median(samples[(backends[0][0], n)]) for n in (1, 8)}
    for name, _, _ in backends:
        one, eight = (statistics.median(samples[(name, n)]) for n in (1, 8))
        rows.append({"backend": name, "steps_s_1": one, "steps_s_8": eight})
        print(
            f"steps  {name:24s} 1 client {one:7.0f} steps/s ({one / base[1]:.2f}x memory) | "
            f"8 clients {eight:7.0f} steps/s ({eight / base[8]:.2f}x memory)  "
            f"[median of {rounds} x {seconds:g}s rounds, 64 sequences per client]",
            flush=True,
        )
    return rows


# ---- 3. recovery ------------------------------------------------------------------------------
def bench_recovery(num_blocks: int, with_postgres: bool) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-rec-"))
    urls = [("sqlite", f"sqlite:///{tmp / 'rec.db'}")]
    cluster = None
    if with_postgres:
        from tests.fixtures.postgres import PostgresCluster

        cluster = PostgresCluster()
        cluster.start()
        urls.append(("postgresql", cluster.create_database()))
    per_seq = 100
    num_seqs = num_blocks // per_seq
    env = {
        "PAGEDKV_SNAPSHOT_INTERVAL_S": "36000",
        "PAGEDKV_SNAPSHOT_EVERY_RECORDS": "1000000",
        "PAGEDKV_MAX_BLOCKS": str(1 << 20),
    }
    try:
        for name, url in urls:
            with bm_server(url, **env) as (target, proc):
                with BlockManagerClient(target, timeout_s=120, scheduler_id="rec") as c:
                    c.register_node("big", num_blocks + num_seqs + 64, block_size=BS)
                    for lo in range(0, num_seqs, 100):  # 100 allocations per journal record
                        st = c.step()
                        for i in range(lo, min(num_seqs, lo + 100)):
                            st.allocate(f"r{i}", "big", num_tokens=per_seq * BS)
                        res = st.commit()
                        if res.failures:
                            raise RuntimeError(f"building the state failed: {res.failures[0]}")
                        for info in res.steps.values():
                            c.report(info, True)
                    st = c.step()
                    for i in range(num_seqs):   # one block more each: 100k + num_seqs in use
                        st.append(f"r{i}", num_new_tokens=1)
                    res = st.commit()
                    if res.failures:
                        raise RuntimeError(f"building the state failed: {res.failures[0]}")
                    used = num_seqs * (per_seq + 1)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            for mode in ("journal replay after SIGKILL", "snapshot after graceful stop"):
                log = tmp / "server.log"
                t0 = time.perf_counter()
                with bm_server(url, log, PAGEDKV_LOG_LEVEL="INFO", **env) as (target, proc):
                    dt = time.perf_counter() - t0
                    recovered = next(json.loads(line) for line in log.read_text().splitlines() if '"recovered"' in line)
                    with AdminClient(target) as admin:
                        n = admin.describe_sequence("r0")
                        if int(n["table"]["num_tokens"]) != per_seq * BS + 1:
                            raise RuntimeError(f"recovered state is wrong: {n}")
                    # leaving the context stops gracefully -> final snapshot for the next mode
                rec_s, replayed = recovered["seconds"], recovered["records"]
                rows.append(
                    {
                        "backend": name,
                        "mode": mode,
                        "blocks_in_use": used,
                        "restart_to_serving_s": dt,
                        "recovery_s": rec_s,
                        "replayed": replayed,
                    }
                )
                print(f"recovery {name:10s} {used} blocks in use, {mode:30s}: restart -> SERVING {dt:.2f} s "
                      f"(recovery itself {rec_s:.2f} s, {replayed} records replayed)", flush=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import block_manager.service.server"], cwd=REPO, check=True)
        base = time.perf_counter() - t0
        print(f"recovery (python start + imports alone: {base:.2f} s)")
        rows.append(
            {"backend": "-", "mode": "process start + imports only", "blocks_in_use": 0, "restart_to_serving_s": base}
        )
    finally:
        if cluster is not None:
            cluster.stop()
    return rows


# ---- 4. RPCs per generated token --------------------------------------------------------------
RPT_MODES = ("step helper + deferred in-block appends", "step helper, every append to the server")


def bench_rpt(batches: list[int], seed: int = 0) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []

    async def run(target: str, batch: int, mode: str, tag: str) -> dict[str, object]:
        async with AsyncBlockManagerClient(target, timeout_s=30, scheduler_id=tag) as c:
            sim = SimScheduler(c, tag, batch, random.Random(seed), defer=mode == RPT_MODES[0])
            await sim.register(pool_blocks(batch))
            target_tokens = 64 * max(batch, 8)
            while sim.generated < target_tokens:
                await sim.step()
            await sim.drain()
            await c.release()
            return {"batch": batch, "mode": mode, "tokens": sim.generated, "rpcs": c.stats.rpcs,
                    "step_rpcs": c.stats.per_method.get("Step", 0)}

    with bm_server("memory://") as (target, _):
        for batch in batches:
            for mode in RPT_MODES:
                row = asyncio.run(run(target, batch, mode, f"rpt{len(rows)}"))
                row["step_rpcs_per_token"] = row["step_rpcs"] / row["tokens"]  # type: ignore[operator]
                rows.append(row)
                print(f"rpt  batch {batch:3d}  {mode:42s} tokens {row['tokens']:6d}  Step RPCs {row['step_rpcs']:5d} "
                      f"({row['step_rpcs_per_token']:.4f}/token)  all RPCs {row['rpcs']}", flush=True)
    return rows


# ---- 5. scale: N schedulers on one block manager -----------------------------------------------
def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_scale(counts: list[int], batch: int, seconds: float) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []

    async def run(target: str, n: int, server_pid: int) -> dict[str, object]:
        clients = [AsyncBlockManagerClient(target, timeout_s=60, scheduler_id=f"s{n}-{i}") for i in range(n)]
        sims = [SimScheduler(c, f"s{n}-{i}", batch, random.Random(i)) for i, c in enumerate(clients)]
        for sim in sims:
            await sim.register(pool_blocks(batch))
        await asyncio.gather(*(sim.step() for sim in sims))   # admissions
        lat: list[float] = []
        rpcs0 = sum(c.stats.per_method.get("Step", 0) for c in clients)
        end = time.perf_counter() + seconds

        async def loop(sim: SimScheduler) -> int:
            steps = 0
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                await sim.step()
                lat.append(time.perf_counter() - t0)
                steps += 1
            return steps

        cpu0, t0 = _proc_cpu_s(server_pid), time.perf_counter()
        steps = sum(await asyncio.gather(*(loop(s) for s in sims)))
        wall, cpu = time.perf_counter() - t0, _proc_cpu_s(server_pid) - cpu0
        rpcs = sum(c.stats.per_method.get("Step", 0) for c in clients) - rpcs0
        for sim in sims:
            await sim.drain()
            await sim.client.release()
        for c in clients:
            await c.close()
        return {"schedulers": n, "seqs_each": batch, "steps_s": steps / wall, "step_rpcs_s": rpcs / wall,
                "p50_ms": 1e3 * percentile(lat, 50), "p99_ms": 1e3 * percentile(lat, 99),
                "server_cpu_ms_per_rpc": 1e3 * cpu / max(rpcs, 1), "server_cpu_util": cpu / wall}

    with bm_server("memory://") as (target, proc):
        for n in counts:
            row = asyncio.run(run(target, n, proc.pid))
            rows.append(row)
            print(f"scale {n:3d} schedulers x {batch} seqs: {row['steps_s']:7.1f} steps/s "
                  f"({row['step_rpcs_s']:6.1f} Step RPCs/s) | step p50 {row['p50_ms']:.2f} "
                  f"p99 {row['p99_ms']:.2f} ms | server CPU {row['server_cpu_ms_per_rpc']:.2f} ms per Step RPC, "
                  f"{100 * row['server_cpu_util']:.0f}% of a core", flush=True)
    return rows


# ---- 6. TLS and auth overhead on the Step RPC -------------------------------------------------
SCHED_TOKEN = "bench-scheduler-token-0123456789"
NODE_TOKEN = "bench-node-token-0123456789abcd"


def bench_tls(sizes: list[int], iters: int) -> list[dict[str, object]]:
    certs = Path(tempfile.mkdtemp(prefix="bench-certs-"))
    subprocess.run(["bash", str(REPO / "scripts" / "gen-dev-certs.sh"), str(certs)], check=True, capture_output=True)

    def tls(name: str) -> TlsSettings:
        return TlsSettings(ca_file=certs / "ca.pem", cert_file=certs / f"{name}.pem",
                           key_file=certs / f"{name}-key.pem")

    mtls_env = {"PAGEDKV_TLS__CERT_FILE": str(certs / "block-manager.pem"),
                "PAGEDKV_TLS__KEY_FILE": str(certs / "block-manager-key.pem"),
                "PAGEDKV_TLS__CA_FILE": str(certs / "ca.pem"), "PAGEDKV_TLS__REQUIRE_CLIENT_CERT": "true"}
    token_env = {"PAGEDKV_AUTH__TOKENS": json.dumps({"scheduler": SCHED_TOKEN, "node:node-0": NODE_TOKEN})}
    # variant -> (server env, server-side TLS for the health wait, client TLS for the scheduler / node, token)
    variants = {
        "plaintext": ({}, None, None, None, None),
        "plaintext + tokens": (token_env, None, None, None, (SCHED_TOKEN, NODE_TOKEN)),
        "mTLS (certificate identities)": (mtls_env, tls("admin"), tls("scheduler"), tls("compute-node-0"), None),
    }
    rows: list[dict[str, object]] = []
    max_n, total = max(sizes), len(sizes) * (iters + 10)
    with contextlib.ExitStack() as stack:
        targets = {}
        for name, (env, wait_tls, sched_tls, node_tls, tokens) in variants.items():
            target = stack.enter_context(bm_server("memory://", tls=wait_tls, **env))[0]
            node_md = (("authorization", f"Bearer {tokens[1]}"),) if tokens else ()
            sched_md = (("authorization", f"Bearer {tokens[0]}"),) if tokens else ()
            with BlockManagerClient(target, tls=node_tls, token=tokens[1] if tokens else None) as node:
                reg = node.register_node("node-0", max_n * ((BS + total + 40) // BS + 3) + 16, block_size=BS)
            client = stack.enter_context(BlockManagerClient(
                target, scheduler_id="bench", tls=sched_tls, token=tokens[0] if tokens else None))
            seq_ids = [f"s{i}" for i in range(max_n)]
            for lo in range(0, max_n, 256):
                st = client.step()
                for i in range(lo, min(max_n, lo + 256)):
                    st.allocate(seq_ids[i], "node-0", [i % 97] * (BS + i % BS))
                for info in st.commit().steps.values():
                    client.report(info, True)
            client.flush_reports()
            channel = stack.enter_context(open_channel(target, sched_tls))
            targets[name] = (pb_grpc.BlockManagerStub(channel), sched_md, reg.epoch, seq_ids, [0], node_md)
        for n in sizes:
            lat: dict[str, list[float]] = {name: [] for name in variants}
            for k in range(iters + 10):
                for name, (stub, md, epoch, seq_ids, last, _) in targets.items():
                    req = _decode_step("node-0", epoch, seq_ids[:n], k, last[0])
                    req.request_id = f"tls-{n}-{k}"
                    t0 = time.perf_counter()
                    resp = stub.Step(req, timeout=30, metadata=md)
                    dt = time.perf_counter() - t0
                    if resp.errors:
                        raise RuntimeError(f"{name}: step failed: {resp.errors[0]}")
                    if resp.steps:
                        last[0] = resp.steps[0].step_id
                    if k >= 10:
                        lat[name].append(dt)
            base = percentile(lat["plaintext"], 50)
            for name in variants:
                p50, p99 = percentile(lat[name], 50), percentile(lat[name], 99)
                rows.append({"seqs": n, "variant": name, "p50_ms": 1e3 * p50, "p99_ms": 1e3 * p99, "ratio": p50 / base})
                print(f"tls {n:4d} seqs  {name:30s} Step p50 {1e3 * p50:.3f} p99 {1e3 * p99:.3f} ms  "
                      f"ratio to plaintext {p50 / base:.2f}", flush=True)
        # Route of 10^6 token ids: accepted with the old 1 << 20 cap, refused with the default
        stub, md, *_ = targets["plaintext"]
        for label, count in (("131072 token ids (default cap: accepted)", 131072),
                             ("10^6 token ids (default cap: refused)", 1_000_000)):
            req = pb.RouteRequest(token_ids=[7] * count)
            t0 = time.perf_counter()
            try:
                stub.Route(req, timeout=60, metadata=md)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = exc.code().name  # type: ignore[attr-defined]
            print(f"tls route {label}: {outcome} in {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    with bm_server("memory://", PAGEDKV_MAX_ROUTE_TOKENS=str(1 << 20)) as (target, _):
        with BlockManagerClient(target) as node:
            node.register_node("node-0", 1024, block_size=BS)
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            t0 = time.perf_counter()
            pb_grpc.BlockManagerStub(ch).Route(pb.RouteRequest(token_ids=[7] * 1_000_000), timeout=60)
            print(f"tls route 10^6 token ids (old cap 1 << 20: accepted): OK in "
                  f"{1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--only", default="step,steps,recovery,rpt,scale,tls")
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = p.parse_args()
    if args.echo_server:
        run_echo_server(args.port_file)
        return
    only = set(args.only.split(","))
    print(
        f"# bench_service  python {sys.version.split()[0]}  grpc {grpc.__version__}  cpus {os.cpu_count()}", flush=True
    )
    if "step" in only:
        bench_step([1, 16, 64, 256, 512], 30 if args.quick else 300)
    if "steps" in only:
        bench_steps(not args.no_postgres, 0.5 if args.quick else 1.5, 2 if args.quick else 5)
    if "recovery" in only:
        bench_recovery(5_000 if args.quick else 100_000, not args.no_postgres)
    if "rpt" in only:
        bench_rpt([1, 8] if args.quick else [1, 8, 64])
    if "scale" in only:
        bench_scale([1, 4] if args.quick else [1, 4, 16], 64 if args.quick else 256, 2.0 if args.quick else 10.0)
    if "tls" in only:
        bench_tls([1, 64, 256], 30 if args.quick else 300)


if __name__ == "__main__":
    main()
