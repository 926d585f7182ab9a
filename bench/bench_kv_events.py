"""KV events: what subscribers cost the Step path (issue 19, item 3).

One block manager process; one scheduler (this process) sends Step RPCs of a workload that
changes the prefix index every step: 32 running sequences decode one token each (block size
16: about two blocks fill and are registered per step), and every 4th step the oldest
sequence is freed and a 256-token prompt (128 shared tokens) is admitted, so the pool fills,
evicts, and offloads to a host tier. Four cases, measured in the same run, interleaved round by
round (off, none, 4 subscribers, 1 stalled subscriber, off, ...):

- `off`: a second block manager, up at the same time, with `kv_events.enabled=false` (nothing
  recorded: the cost of the feature itself), driven by its own scheduler the same way;
- `none`: KV events on, nobody subscribed;
- `4 subscribers`: four streams, each on its own channel, read as fast as they come by a
  separate process (as external routers would);
- `stalled`: one stream that reads its first message and then nothing (its channel has BDP
  probing off, so the server's writes to it block after ~64 KiB): it is dropped to a Resync.

Reported: Step RPC latency p50/p99 per attachment over all rounds, the ratios to `none`, the
events the subscribers received, and the server's CPU per Step (from /proc).

    .venv/bin/python bench/bench_kv_events.py [--rounds 3] [--steps 400] [--store memory|sqlite]
"""

from __future__ import annotations

import argparse
import json
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_service as bs  # noqa: E402

from demo.localstack import ServiceProcess  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
from pagedkv.v1 import block_manager_pb2 as pb  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402

BS = 16
NUM_RUNNING = 32
PROMPT = 256
SHARED = 128
SCHEDULER = "bench-kv-events"


# ---- the subscriber process -------------------------------------------------------------------
def subscriber_main(target: str, num: int, stall: bool) -> None:
    """`num` streams, each on its own channel; prints READY once each got its first message,
    and the events each received when SIGTERM arrives."""
    counts = [0] * num
    ready = threading.Barrier(num + 1)
    calls = []

    def read(i: int) -> None:
        options = [("grpc.http2.bdp_probe", 0)] if stall else []
        channel = grpc.insecure_channel(target, options=options)
        call = pb_grpc.BlockManagerStub(channel).SubscribeKvEvents(pb.SubscribeKvEventsRequest(live_only=True))
        calls.append(call)
        first = True
        try:
            for resp in call:
                counts[i] += len(resp.events)
                if first:
                    first = False
                    ready.wait()
                    if stall:
                        threading.Event().wait()   # never read again
        except grpc.RpcError:
            pass

    def on_term(*_: object) -> None:
        print(json.dumps({"events": counts}), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    for i in range(num):
        threading.Thread(target=read, args=(i,), daemon=True).start()
    # live-only streams send nothing until the first event: the scheduler makes one per step
    # while waiting for READY (it steps until the subscribers answer)
    ready.wait()
    print("READY", flush=True)
    threading.Event().wait()


# ---- the scheduler ------------------------------------------------------------------------------
class Workload:
    def __init__(self, stub: pb_grpc.BlockManagerStub, seed: int = 0) -> None:
        self.stub = stub
        self.rng = random.Random(seed)
        self.epoch = 0
        self.done = 0
        self.n = 0
        self.running: list[tuple[str, int]] = []   # (seq id, num tokens)
        self.shared = [self.rng.randrange(1, 30000) for _ in range(SHARED)]

    def register(self) -> None:
        r = self.stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg", node_id="n1", num_blocks=1024,
                                                          host_num_blocks=512, block_size=BS), timeout=30)
        self.epoch = r.epoch

    def _prompt(self) -> list[int]:
        return self.shared + [self.rng.randrange(1, 30000) for _ in range(PROMPT - SHARED)]

    def request(self) -> pb.StepRequest:
        self.n += 1
        m = pb.StepRequest(request_id=f"step-{self.n}", scheduler_id=SCHEDULER)
        if self.done:
            m.reports.add(pool_id="n1", epoch=self.epoch, completed_up_to=self.done)
        if self.n % 4 == 0 or len(self.running) < NUM_RUNNING:
            if len(self.running) >= NUM_RUNNING:
                sid, _ = self.running.pop(0)
                m.free_seq_ids.append(sid)
            prompt = self._prompt()
            sid = f"s{self.n}"
            m.pool_ids.append("n1")
            m.alloc_seq_ids.append(sid)
            m.alloc_pool_index.append(0)
            m.alloc_salt_index.append(-1)
            m.alloc_num_token_ids.append(len(prompt))
            m.alloc_token_ids.extend(prompt)
            m.alloc_num_tokens.append(0)
            m.alloc_num_compute.append(0)
            self.running.append((sid, len(prompt)))
        for i, (sid, num) in enumerate(self.running[:-1]):
            m.append_seq_ids.append(sid)
            m.append_num_tokens.append(1)
            m.append_token_ids.append(self.rng.randrange(1, 30000))
            self.running[i] = (sid, num + 1)
        return m

    def step(self) -> float:
        req = self.request()
        t0 = time.perf_counter()
        resp = self.stub.Step(req, timeout=30)
        dt = time.perf_counter() - t0
        if resp.errors:
            raise SystemExit(f"step failed: {resp.errors[0]}")
        for ps in resp.steps:
            self.done = max(self.done, ps.step_id)
        return dt


def attach(target: str, num: int, stall: bool, wl: Workload) -> subprocess.Popen | None:
    if num == 0:
        return None
    argv = [sys.executable, __file__, "--subscriber", target, str(num)] + (["--stall"] if stall else [])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
    # live-only streams say nothing before the first event: step until every one answered
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)   # type: ignore[arg-type]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        wl.step()
        if sel.select(timeout=0.05):
            line = proc.stdout.readline()   # type: ignore[union-attr]
            if line.strip() == "READY":
                return proc
    raise SystemExit("subscribers did not start")


def detach(proc: subprocess.Popen | None) -> list[int]:
    if proc is None:
        return []
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    for line in out.splitlines():
        if line.startswith("{"):
            return json.loads(line)["events"]
    return []


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400, help="measured steps per attachment per round")
    ap.add_argument("--store", choices=["memory", "sqlite"], default="memory")
    ap.add_argument("--subscriber", nargs=2, metavar=("TARGET", "N"))
    ap.add_argument("--stall", action="store_true")
    args = ap.parse_args()
    if args.subscriber:
        subscriber_main(args.subscriber[0], int(args.subscriber[1]), args.stall)
        return
    with tempfile.TemporaryDirectory() as tmp:
        db = "memory://" if args.store == "memory" else f"sqlite:///{tmp}/bm.db"
        argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url", db]
        env = bs.server_env(PAGEDKV_BLOCK_SIZE=str(BS), PAGEDKV_SQLITE_SYNCHRONOUS="NORMAL")
        if args.store == "sqlite":
            argv_off = [*argv[:-1], f"sqlite:///{tmp}/bm-off.db"]
        else:
            argv_off = argv
        server = ServiceProcess.start(argv, workdir=Path(tmp), name="bm", env=env, cwd=REPO, timeout_s=60)
        off = ServiceProcess.start(argv_off, workdir=Path(tmp), name="bm-off",
                                   env={**env, "PAGEDKV_KV_EVENTS__ENABLED": "false"}, cwd=REPO, timeout_s=60)
        try:
            wl = Workload(pb_grpc.BlockManagerStub(grpc.insecure_channel(server.address)))
            wl_off = Workload(pb_grpc.BlockManagerStub(grpc.insecure_channel(off.address)))
            for w in (wl, wl_off):
                w.register()
                for _ in range(200):   # fill the pool: evictions and offloads from here on
                    w.step()
            phases = [("off", 0, False), ("none", 0, False), ("4 subscribers", 4, False), ("stalled", 1, True)]
            lat: dict[str, list[float]] = {p[0]: [] for p in phases}
            cpu: dict[str, float] = {p[0]: 0.0 for p in phases}
            received: dict[str, list[int]] = {p[0]: [] for p in phases}
            for _ in range(args.rounds):
                for name, num, stall in phases:
                    w, srv = (wl_off, off) if name == "off" else (wl, server)
                    proc = attach(srv.address, num, stall, w)
                    for _ in range(20):
                        w.step()
                    c0 = server_cpu_s(srv.proc.pid)
                    lat[name] += [w.step() for _ in range(args.steps)]
                    cpu[name] += server_cpu_s(srv.proc.pid) - c0
                    received[name] += detach(proc)
        finally:
            server.stop()
            off.stop()
    base = percentile(lat["none"], 50)
    base99 = percentile(lat["none"], 99)
    base_cpu = cpu["none"] / len(lat["none"])
    print(f"store={args.store} rounds={args.rounds} steps/attachment/round={args.steps} "
          f"(block size {BS}, {NUM_RUNNING} running, a {PROMPT}-token admission every 4th step)")
    print("ratios are to `none` (KV events on, nobody subscribed)")
    print(f"{'attachment':<15} {'p50 ms':>8} {'p99 ms':>8} {'p50 ratio':>10} {'p99 ratio':>10} "
          f"{'server CPU ms/step':>19} {'CPU ratio':>10}  events received per subscriber")
    for name, samples in lat.items():
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        per_step = 1000 * cpu[name] / len(samples)
        print(f"{name:<15} {1000 * p50:8.3f} {1000 * p99:8.3f} {p50 / base:10.3f} {p99 / base99:10.3f} "
              f"{per_step:19.3f} {per_step / (1000 * base_cpu):10.3f}  {_counts(received[name])}")


def _counts(received: list[int]) -> str:
    if not received:
        return "-"
    return f"{len(received)} streams, {min(received)}-{max(received)} events each"


if __name__ == "__main__":
    main()
