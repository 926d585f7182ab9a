"""Block manager service benchmarks (issue 3), client and servers in separate processes.

1. `append`: AppendSlots p50/p99 for 1/16/64/256/512 decode sequences (one token each),
   next to a bare gRPC echo (generic handler, raw bytes) with the same request and
   response sizes, measured in the same run; ratio = AppendSlots p50 / echo p50.
2. `steps`: decode steps/s (one AppendSlots of 64 sequences per step) against memory://,
   durable SQLite (WAL, synchronous=FULL) and PostgreSQL (throwaway cluster, fsync=on),
   with 1 client and with 8 concurrent clients (group commit).
3. `recovery`: 100k blocks in use; SIGKILL the server, restart, time until health SERVING
   (journal replay only, and from the final snapshot after a graceful stop).
4. `rpt`: RPCs per generated token for a continuous-batching decode workload through the
   client's step helper (with and without deferred in-block appends) vs one AppendSlots
   per sequence.

    .venv/bin/python bench/bench_service.py [--only append,steps,recovery,rpt] [--no-postgres] [--quick]
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

from block_manager.client import AsyncBlockManagerClient, BlockManagerClient, RetryPolicy  # noqa: E402
from block_manager.client.types import AllocateSpec, ItemFailure  # noqa: E402
from block_manager.core.types import AppendRequest, PoolId, SeqId  # noqa: E402
from engine.localstack import ServiceProcess  # noqa: E402
from pagedkv.lifecycle import write_port_file  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
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


def wait_serving(target: str, timeout_s: float = 120.0) -> None:
    """Block on the health service's Watch stream until SERVING (no polling)."""
    with grpc.insecure_channel(target) as ch:
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
    database_url: str, log_file: Path | None = None, **env: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-bm-")) if log_file is None else log_file.parent
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url"]
    name = log_file.stem if log_file else "bm"
    env = server_env(**env)
    with ServiceProcess.start([*argv, database_url], workdir=workdir, name=name, env=env, cwd=REPO) as server:
        wait_serving(server.address)
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


# ---- helpers ---------------------------------------------------------------------------
def setup_decode(c: BlockManagerClient, node: str, num_seqs: int, num_steps: int, prefix: str = "s") -> list[SeqId]:
    c.register_node(node, num_seqs * (2 + (BS + num_steps) // BS) + 16, block_size=BS)
    seq_ids = [SeqId(f"{prefix}{i}") for i in range(num_seqs)]
    for lo in range(0, num_seqs, 1024):
        outs = c.allocate([AllocateSpec(s, PoolId(node), tuple(range(BS)), None) for s in seq_ids[lo : lo + 1024]])
        if any(not hasattr(o, "block_table") for o in outs):
            raise RuntimeError(f"allocation failed: {outs[0]}")
    return seq_ids


# ---- 1. AppendSlots vs echo --------------------------------------------------------------
def bench_append(sizes: list[int], iters: int) -> list[dict[str, float]]:
    rows = []
    with bm_server("memory://") as (target, _), echo_server() as echo_target:
        with BlockManagerClient(target) as c, grpc.insecure_channel(echo_target) as ech:
            stub = pb_grpc.BlockManagerStub(grpc.insecure_channel(target))
            echo = ech.unary_unary(ECHO_METHOD)
            for n in sizes:
                seq_ids = setup_decode(c, f"node{n}", n, iters + 80, prefix=f"n{n}-")
                items = [pb.AppendItem(seq_id=s, num_new_tokens=1, token_ids=[7]) for s in seq_ids]
                bm_lat, cl_lat, echo_lat = [], [], []
                req_size = resp_size = 0
                for k in range(iters + 10):
                    req = pb.AppendSlotsRequest(request_id=f"a{n}-{k}", items=items)
                    t0 = time.perf_counter()
                    resp = stub.AppendSlots(req, timeout=30)
                    dt = time.perf_counter() - t0
                    if resp.outcomes[-1].HasField("error"):
                        raise RuntimeError(f"append failed: {resp.outcomes[-1].error}")
                    req_size, resp_size = req.ByteSize(), resp.ByteSize()
                    payload = struct.pack("<I", resp_size) + b"\x00" * max(0, req_size - 4)
                    t0 = time.perf_counter()
                    echo(payload, timeout=30)
                    de = time.perf_counter() - t0
                    if k >= 10:  # warm-up
                        bm_lat.append(dt)
                        echo_lat.append(de)
                reqs = [AppendRequest(s, 1, (7,)) for s in seq_ids]
                for _ in range(min(iters, 50)):
                    t0 = time.perf_counter()
                    outs = c.append_slots(reqs)
                    cl_lat.append(time.perf_counter() - t0)
                    if isinstance(outs[-1], ItemFailure):
                        raise RuntimeError(f"append failed: {outs[-1]}")
                row = {
                    "seqs": n, "req_bytes": req_size, "resp_bytes": resp_size,
                    "bm_p50_ms": 1e3 * percentile(bm_lat, 50), "bm_p99_ms": 1e3 * percentile(bm_lat, 99),
                    "echo_p50_ms": 1e3 * percentile(echo_lat, 50), "echo_p99_ms": 1e3 * percentile(echo_lat, 99),
                    "client_p50_ms": 1e3 * percentile(cl_lat, 50),
                }
                row["ratio_p50"] = row["bm_p50_ms"] / row["echo_p50_ms"]
                rows.append(row)
                print(
                    f"append {n:4d} seqs  req {req_size:6d}B resp {resp_size:6d}B  "
                    f"AppendSlots p50 {row['bm_p50_ms']:.3f} p99 "
                    f"{row['bm_p99_ms']:.3f} ms | echo p50 {row['echo_p50_ms']:.3f} p99 {row['echo_p99_ms']:.3f} ms | "
                    f"ratio {row['ratio_p50']:.2f} | via client lib p50 {row['client_p50_ms']:.3f} ms",
                    flush=True,
                )
    return rows


# ---- 2. steps/s per backend --------------------------------------------------------------
async def _async_steps(target: str, tag: str, num_clients: int, num_seqs: int, seconds: float) -> float:
    """Decode steps/s summed over `num_clients` concurrent clients, each with its own node
    (fresh per round, sized so no append can run out of blocks)."""

    async def one(idx: int) -> int:
        node = f"{tag}-w{idx}"
        async with AsyncBlockManagerClient(target, retry=RetryPolicy(max_attempts=1)) as c:
            await c.register_node(node, num_seqs * 128 + 16, block_size=BS)
            sids = [SeqId(f"{node}-{i}") for i in range(num_seqs)]
            await c.allocate([AllocateSpec(s, PoolId(node), None, BS) for s in sids])
            reqs = [AppendRequest(s, 1, None) for s in sids]
            steps = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                outs = await c.append_slots(reqs)
                if not hasattr(outs[-1], "slot_mapping"):
                    raise RuntimeError(f"append failed: {outs[-1]}")
                steps += 1
            await c.free(sids)
            return steps

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_clients)))
    return sum(counts) / (time.perf_counter() - t0)


def bench_steps(with_postgres: bool, seconds: float, rounds: int) -> list[dict[str, object]]:
    """All backends' servers run at once; short rounds alternate between them and the
    median per backend is reported, so load drift from other processes hits all alike."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-svc-"))
    backends: list[tuple[str, str]] = [("memory", "memory://"), ("sqlite (WAL, FULL)", f"sqlite:///{tmp / 'bm.db'}")]
    cluster = None
    if with_postgres:
        from tests.fixtures.postgres import PostgresCluster

        cluster = PostgresCluster()
        cluster.start()
        backends.append(("postgresql (fsync=on)", cluster.create_database()))
    samples: dict[tuple[str, int], list[float]] = {(name, n): [] for name, _ in backends for n in (1, 8)}
    try:
        with contextlib.ExitStack() as stack:
            targets = [
                (name, stack.enter_context(bm_server(url, PAGEDKV_SNAPSHOT_INTERVAL_S="3600"))[0])
                for name, url in backends
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
    for name, _ in backends:
        one, eight = (statistics.median(samples[(name, n)]) for n in (1, 8))
        rows.append({"backend": name, "steps_s_1": one, "steps_s_8": eight})
        print(
            f"steps  {name:24s} 1 client {one:7.0f} steps/s ({one / base[1]:.2f}x memory) | "
            f"8 clients {eight:7.0f} steps/s ({eight / base[8]:.2f}x memory)  "
            f"[median of {rounds} x {seconds:g}s rounds]",
            flush=True,
        )
    return rows


# ---- 3. recovery --------------------------------------------------------------------------
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
                with BlockManagerClient(target, timeout_s=120) as c:
                    c.register_node("big", num_blocks + num_seqs + 64, block_size=BS)
                    outs: list[object] = []
                    for lo in range(0, num_seqs, 100):  # 100 allocations per journal record
                        outs += c.allocate(
                            [
                                AllocateSpec(SeqId(f"r{i}"), PoolId("big"), None, per_seq * BS)
                                for i in range(lo, min(num_seqs, lo + 100))
                            ]
                        )
                    reqs = [AppendRequest(SeqId(f"r{i}"), 1, None) for i in range(num_seqs)]
                    outs += c.append_slots(reqs)  # one block more each: 100k + num_seqs in use
                    if any(isinstance(o, ItemFailure) for o in outs):
                        raise RuntimeError(
                            "building the state failed: " + str(next(o for o in outs if isinstance(o, ItemFailure)))
                        )
                    used = num_seqs * (per_seq + 1)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            for mode in ("journal replay after SIGKILL", "snapshot after graceful stop"):
                log = tmp / "server.log"
                t0 = time.perf_counter()
                with bm_server(url, log, PAGEDKV_LOG_LEVEL="INFO", **env) as (target, proc):
                    dt = time.perf_counter() - t0
                    recovered = next(json.loads(line) for line in log.read_text().splitlines() if '"recovered"' in line)
                    with BlockManagerClient(target) as c:
                        check = c.append_slots([AppendRequest(SeqId("r0"), 1, None)])[0]
                        if not hasattr(check, "slot_mapping"):
                            raise RuntimeError(f"recovered state is wrong: {check}")
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


# ---- 4. RPCs per generated token ----------------------------------------------------------
RPT_MODES = ("step helper + deferred appends", "step helper, no deferral", "one AppendSlots per sequence")


def bench_rpt(batches: list[int], seed: int = 0) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with bm_server("memory://") as (target, _):
        for batch, mode in [(b, m) for b in batches for m in RPT_MODES if b <= 8 or m != RPT_MODES[2]]:
            num_finished = max(16, 4 * batch)
            rng = random.Random(seed)
            node = f"rpt{len(rows)}"
            with BlockManagerClient(target, timeout_s=30) as c:
                c.register_node(node, batch * 64, block_size=BS)
                if mode != "step helper + deferred appends":
                    c.tracker.block_sizes.clear()  # the helper cannot answer locally
                live: dict[str, int] = {}  # seq -> tokens still to generate
                next_id = finished = generated = 0
                c.stats.rpcs = 0
                while finished < num_finished:
                    step = c.step()
                    done = [s for s, left in live.items() if left == 0]
                    if done:
                        step.free(done)
                        finished += len(done)
                        for s in done:
                            del live[s]
                    admitted: set[str] = set()
                    while len(live) < batch and next_id < num_finished + batch:
                        sid = f"{node}-{next_id}"
                        next_id += 1
                        step.allocate(sid, node, [rng.randrange(32000) for _ in range(rng.randint(16, 300))])
                        live[sid] = rng.randint(32, 256)
                        admitted.add(sid)
                    decoding = [s for s in live if s not in admitted]  # admitted ones ran prefill
                    if mode == "one AppendSlots per sequence":
                        step.commit()
                        for sid in decoding:
                            c.append_slots([AppendRequest(SeqId(sid), 1, (rng.randrange(32000),))])
                    else:
                        for sid in decoding:
                            step.append(sid, [rng.randrange(32000)])
                        step.commit()
                    for sid in decoding:
                        live[sid] -= 1
                        generated += 1
                per_method = dict(c.stats.per_method)
                decode_rpcs = per_method.get("AppendSlots", 0)
                rows.append(
                    {
                        "batch": batch,
                        "mode": mode,
                        "tokens": generated,
                        "rpcs": c.stats.rpcs,
                        "append_rpcs": decode_rpcs,
                        "rpcs_per_token": c.stats.rpcs / generated,
                        "append_rpcs_per_token": decode_rpcs / generated,
                    }
                )
                print(
                    f"rpt  batch {batch:3d}  {mode:32s} tokens {generated:6d}  "
                    f"all RPCs {c.stats.rpcs:6d} ({c.stats.rpcs / generated:.4f}/token)  "
                    f"AppendSlots {decode_rpcs:6d} ({decode_rpcs / generated:.4f}/token)  per method {per_method}",
                    flush=True,
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--only", default="append,steps,recovery,rpt")
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
    if "append" in only:
        bench_append([1, 16, 64, 256, 512], 30 if args.quick else 300)
    if "steps" in only:
        bench_steps(not args.no_postgres, 0.5 if args.quick else 1.5, 2 if args.quick else 5)
    if "recovery" in only:
        bench_recovery(5_000 if args.quick else 100_000, not args.no_postgres)
    if "rpt" in only:
        bench_rpt([1, 8] if args.quick else [1, 8, 64])


if __name__ == "__main__":
    main()
