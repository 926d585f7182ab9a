"""The vLLM-format ZMQ publisher: what it costs the Step path (issue 44, item 4; goal <= 1.05x).

Two block manager processes up at the same time, the same config but for one thing: `plain`
has KV events on without ZMQ (the gRPC stream's hub only, nobody subscribed), `zmq` also has
the ZMQ publisher (PUB + replay ROUTER, `kv_events.zmq_endpoint`). One scheduler (this
process) drives each with the workload of bench_kv_events.py (32 decoding sequences, block size
16, a 256-token admission every 4th step; the pool fills, evicts and offloads to a host tier:
BlockStored / BlockRemoved on GPU and CPU every step). Three cases, interleaved round by round:

- `plain`: no ZMQ publisher;
- `zmq`: the publisher attached, no subscriber (it still translates, encodes and sends);
- `zmq + sub`: a separate process subscribed to every topic, decoding every batch with msgspec
  as a vLLM consumer would.

Steps alternate between the two servers (one each in turn), so both see the same background
load; rounds without and with the subscriber alternate. Reported: Step RPC latency p50/p99
per case over all rounds, the ratio of `zmq` to `plain` in the same rounds, each server's CPU
per Step (from /proc), and the batches/events the subscriber decoded.

    .venv/bin/python bench/bench_kv_events_zmq.py [--rounds 3] [--steps 400] [--store memory|sqlite]
"""

from __future__ import annotations

import argparse
import json
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_kv_events as bke  # noqa: E402
import bench_service as bs  # noqa: E402

from demo.localstack import ServiceProcess  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402


def subscriber_main(endpoint: str) -> None:
    """SUB on every topic; decodes each batch; prints READY at the first, counts at SIGTERM."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder()
    counts = {"batches": 0, "events": 0, "last_seq": -1, "gaps": 0}

    def on_term(*_: object) -> None:
        print(json.dumps(counts), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        _topic, seq, payload = sub.recv_multipart()
        n = int.from_bytes(seq, "big")
        if counts["last_seq"] >= 0 and n != counts["last_seq"] + 1:
            counts["gaps"] += 1
        counts["last_seq"] = n
        ts, events, _rank = decoder.decode(payload)
        counts["batches"] += 1
        counts["events"] += len(events)
        if counts["batches"] == 1:
            print("READY", flush=True)


def attach(endpoint: str, wl: bke.Workload) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--subscriber", endpoint], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)   # type: ignore[arg-type]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        wl.step()   # a PUB subscriber sees what is sent after it connected: step until it has
        if sel.select(timeout=0.05):
            if proc.stdout.readline().strip() == "READY":   # type: ignore[union-attr]
                return proc
    raise SystemExit("the ZMQ subscriber did not start")


def detach(proc: subprocess.Popen | None) -> dict | None:
    if proc is None:
        return None
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    for line in out.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400, help="measured steps per case per round")
    ap.add_argument("--store", choices=["memory", "sqlite"], default="memory")
    ap.add_argument("--subscriber", metavar="ENDPOINT")
    args = ap.parse_args()
    if args.subscriber:
        subscriber_main(args.subscriber)
        return
    with tempfile.TemporaryDirectory() as tmp:
        def argv(name: str) -> list[str]:
            db = "memory://" if args.store == "memory" else f"sqlite:///{tmp}/{name}.db"
            return [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0",
                    "--database-url", db]

        env = bs.server_env(PAGEDKV_BLOCK_SIZE=str(bke.BS), PAGEDKV_SQLITE_SYNCHRONOUS="NORMAL")
        plain = ServiceProcess.start(argv("plain"), workdir=Path(tmp), name="bm-plain", env=env, cwd=REPO,
                                     timeout_s=60)
        # the PUB port: a free one picked here, so the subscriber knows where to connect
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            zport = s.getsockname()[1]
        endpoint = f"tcp://127.0.0.1:{zport}"
        zmq_srv = ServiceProcess.start(
            [*argv("zmq"), "--kv-events-zmq", endpoint, "--kv-events-zmq-replay", "tcp://127.0.0.1:0"],
            workdir=Path(tmp), name="bm-zmq", env=env, cwd=REPO, timeout_s=60)
        try:
            wl_plain = bke.Workload(pb_grpc.BlockManagerStub(grpc.insecure_channel(plain.address)))
            wl_zmq = bke.Workload(pb_grpc.BlockManagerStub(grpc.insecure_channel(zmq_srv.address)))
            for w in (wl_plain, wl_zmq):
                w.register()
                for _ in range(200):   # fill the pool: evictions and offloads from here on
                    w.step()
            # Steps alternate between the two servers, one each in turn, so both see the same
            # background load (this machine is shared); rounds alternate without and with a
            # subscriber attached to the zmq server.
            cases = ["plain", "zmq", "plain (sub round)", "zmq + sub"]
            lat: dict[str, list[float]] = {c: [] for c in cases}
            cpu: dict[str, float] = dict.fromkeys(cases, 0.0)
            received: list[dict] = []
            for r in range(2 * args.rounds):
                with_sub = r % 2 == 1
                proc = attach(endpoint, wl_zmq) if with_sub else None
                names = ("plain (sub round)", "zmq + sub") if with_sub else ("plain", "zmq")
                for _ in range(20):
                    wl_plain.step()
                    wl_zmq.step()
                c_plain, c_zmq = bke.server_cpu_s(plain.proc.pid), bke.server_cpu_s(zmq_srv.proc.pid)
                for _ in range(args.steps):
                    lat[names[0]].append(wl_plain.step())
                    lat[names[1]].append(wl_zmq.step())
                cpu[names[0]] += bke.server_cpu_s(plain.proc.pid) - c_plain
                cpu[names[1]] += bke.server_cpu_s(zmq_srv.proc.pid) - c_zmq
                got = detach(proc)
                if got is not None:
                    received.append(got)
        finally:
            plain.stop()
            zmq_srv.stop()
    print(f"store={args.store} rounds={args.rounds} x2 steps/case/round={args.steps} (block size {bke.BS}, "
          f"{bke.NUM_RUNNING} running, a {bke.PROMPT}-token admission every 4th step); steps alternate "
          "between the servers")
    print(f"{'case':<18} {'p50 ms':>8} {'p99 ms':>8} {'p50 ratio':>10} {'p99 ratio':>10} "
          f"{'server CPU ms/step':>19} {'CPU ratio':>10}")
    for case, ref in (("plain", "plain"), ("zmq", "plain"), ("plain (sub round)", "plain (sub round)"),
                      ("zmq + sub", "plain (sub round)")):
        samples, base = lat[case], lat[ref]
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        per_step, base_step = 1000 * cpu[case] / len(samples), 1000 * cpu[ref] / len(base)
        print(f"{case:<18} {1000 * p50:8.3f} {1000 * p99:8.3f} {p50 / percentile(base, 50):10.3f} "
              f"{p99 / percentile(base, 99):10.3f} {per_step:19.3f} {per_step / base_step:10.3f}")
    print("ratios: zmq to plain in the same rounds (its line above it)")
    for i, got in enumerate(received):
        print(f"subscriber round {i + 1}: {got['batches']} batches, {got['events']} events decoded, "
              f"{got['gaps']} sequence gaps")


if __name__ == "__main__":
    main()
