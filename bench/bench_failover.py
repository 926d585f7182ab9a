"""Active/standby failover benchmark (real processes, a throwaway PostgreSQL cluster).

Failover time: a leader and a standby block manager on one database; one scheduler sends
Steps back to back (an append of 2 tokens to one of 8 sequences, each resent under its request
id to the other address until acknowledged); the leader is killed with SIGKILL; the time from
the kill to the first Step acknowledged by the new leader is one trial. The killed process is
restarted as the next standby, so each trial starts from the same shape. p50/p99 over N trials.

Step latency with a standby vs none: two leaders on two databases of the same cluster, one
with a standby polling its lock; the same Step alternates between them, so both see the same
machine load (p50/p99 over the same number of Steps). Every Step is a durable commit.

    .venv/bin/python bench/bench_failover.py [--trials 10] [--lease 2] [--steps 400] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from demo.localstack import ServiceProcess  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
from pagedkv.v1 import block_manager_pb2 as pb  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NUM_SEQS = 8


def start(url: str, tmp: Path, name: str, lease_s: float, failover: bool = True) -> ServiceProcess:
    env = {
        **os.environ, "PYTHONPATH": str(REPO), "PAGEDKV_BLOCK_SIZE": "16", "PAGEDKV_LEASE_TTL_S": "600",
        "PAGEDKV_DEFRAG__ENABLED": "false", "PAGEDKV_LOG_LEVEL": "WARNING",
        "PAGEDKV_FAILOVER__ENABLED": "true" if failover else "false", "PAGEDKV_FAILOVER__LEASE_S": str(lease_s),
        "PAGEDKV_STORE_LOCK_WAIT_S": "30",
    }
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url", url]
    return ServiceProcess.start(argv, workdir=tmp, name=name, env=env, cwd=REPO, timeout_s=60)


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_serving(address: str) -> None:
    for _ in range(1200):
        if await serving(address):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{address} never served")


class Scheduler:
    """Steps to whichever of `addresses` answers; resends under the same id."""

    def __init__(self, addresses: list[str], tag: str) -> None:
        self.addresses = addresses
        self.channels = {a: grpc.aio.insecure_channel(a) for a in addresses}
        self.current = 0
        self.tag = tag
        self.n = 0
        self.last_step = 0

    async def register_and_allocate(self) -> None:
        stub = pb_grpc.BlockManagerStub(self.channels[self.addresses[self.current]])
        reg = pb.RegisterNodeRequest(request_id=f"reg-{self.tag}", node_id=self.tag, num_blocks=65536)
        await stub.RegisterNode(reg)
        req = pb.StepRequest(request_id=f"{self.tag}-alloc", scheduler_id=self.tag)
        for i in range(NUM_SEQS):
            req.alloc_seq_ids.append(f"{self.tag}-s{i}")
            req.alloc_pool_index.append(0)
            req.alloc_salt_index.append(-1)
            req.alloc_num_token_ids.append(0)
            req.alloc_num_tokens.append(16)
            req.alloc_num_compute.append(0)
        req.pool_ids.append(self.tag)
        await self.step(req)

    def next_request(self) -> pb.StepRequest:
        self.n += 1
        req = pb.StepRequest(request_id=f"{self.tag}-{self.n}", scheduler_id=self.tag)
        req.reports.add(pool_id=self.tag, epoch=1, completed_up_to=self.last_step, failed_from=0)
        req.append_seq_ids.append(f"{self.tag}-s{self.n % NUM_SEQS}")
        req.append_num_tokens.append(2)
        return req

    async def step(self, req: pb.StepRequest) -> str:
        while True:
            address = self.addresses[self.current]
            try:
                resp = await pb_grpc.BlockManagerStub(self.channels[address]).Step(req, timeout=2)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                self.current = (self.current + 1) % len(self.addresses)
                await asyncio.sleep(0.005)
                continue
            for ps in resp.steps:
                self.last_step = max(self.last_step, ps.step_id)
            return address

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


async def step_latency(
    urls: tuple[str, str], tmp: Path, lease_s: float, num_steps: int
) -> tuple[list[float], list[float]]:
    """Two leaders on two databases, one with a standby polling its lock; Steps alternate
    between them (side by side, same machine load). Returns (alone, with standby) in ms."""
    alone = start(urls[0], tmp, "lat-alone", lease_s)
    paired = start(urls[1], tmp, "lat-paired", lease_s)
    standby = None
    try:
        await wait_serving(alone.address)
        await wait_serving(paired.address)
        standby = start(urls[1], tmp, "lat-standby", lease_s)
        scheds = [Scheduler([alone.address], "alone"), Scheduler([paired.address], "paired")]
        times: list[list[float]] = [[], []]
        for sched in scheds:
            await sched.register_and_allocate()
        for i in range(num_steps + 20):
            for k, sched in enumerate(scheds):
                t0 = time.perf_counter()
                await sched.step(sched.next_request())
                if i >= 20:
                    times[k].append((time.perf_counter() - t0) * 1e3)
        for sched in scheds:
            await sched.close()
        return times[0], times[1]
    finally:
        alone.stop()
        paired.stop()
        if standby is not None:
            standby.stop()


async def failover_trials(url: str, tmp: Path, lease_s: float, num_trials: int) -> list[float]:
    leader = start(url, tmp, "p0", lease_s)
    await wait_serving(leader.address)
    standby = start(url, tmp, "p1", lease_s)
    results = []
    try:
        sched = Scheduler([leader.address, standby.address], "fo")
        await sched.register_and_allocate()
        for trial in range(num_trials):
            for _ in range(30):   # load before the kill
                await sched.step(sched.next_request())
            killed_address = leader.address
            acks: list[tuple[float, str]] = []
            load_stop = asyncio.Event()

            async def load() -> None:
                while not load_stop.is_set():
                    address = await sched.step(sched.next_request())
                    acks.append((time.monotonic(), address))

            task = asyncio.create_task(load())
            await asyncio.sleep(0.05)
            killed_at = time.monotonic()
            leader.stop(signal.SIGKILL)
            while not any(t > killed_at and a != killed_address for t, a in acks):
                await asyncio.sleep(0.002)
            load_stop.set()
            await task
            first = min(t for t, a in acks if t > killed_at and a != killed_address)
            results.append(first - killed_at)
            print(f"trial {trial + 1}: {1e3 * (first - killed_at):.0f} ms", file=sys.stderr)
            # The killed one comes back as the next standby, on a new port.
            name = f"p{trial + 2}"
            new_standby = start(url, tmp, name, lease_s)
            leader, standby = standby, new_standby
            await sched.close()
            sched.addresses = [leader.address, standby.address]
            sched.channels = {a: grpc.aio.insecure_channel(a) for a in sched.addresses}
            sched.current = 0
        await sched.close()
    finally:
        leader.stop(signal.SIGKILL)
        standby.stop(signal.SIGKILL)
    return results


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values), "n": len(values)}


async def main_async(args: argparse.Namespace) -> dict:
    from tests.fixtures.postgres import PostgresCluster

    out: dict = {"lease_s": args.lease}
    with PostgresCluster() as cluster, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        url = cluster.create_database("failover")
        out["failover_s"] = summary(await failover_trials(url, tmp, args.lease, args.trials))
        urls = (cluster.create_database("lat_alone"), cluster.create_database("lat_standby"))
        alone, with_sb = await step_latency(urls, tmp, args.lease, args.steps)
        out["step_ms_leader_alone"] = summary(alone)
        out["step_ms_with_standby"] = summary(with_sb)
        out["p50_ratio"] = out["step_ms_with_standby"]["p50"] / out["step_ms_leader_alone"]["p50"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        f = out["failover_s"]
        print(f"failover (kill -9 -> first acknowledged Step on the new leader), lease {args.lease} s, "
              f"{f['n']} trials: p50 {1e3 * f['p50']:.0f} ms, p99 {1e3 * f['p99']:.0f} ms, max {1e3 * f['max']:.0f} ms")
        a, s = out["step_ms_leader_alone"], out["step_ms_with_standby"]
        print(f"Step latency: leader alone p50 {a['p50']:.3f} / p99 {a['p99']:.3f} ms; with a standby "
              f"p50 {s['p50']:.3f} / p99 {s['p99']:.3f} ms; p50 ratio {out['p50_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
