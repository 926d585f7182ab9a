"""What exactly-once by client sessions costs on the hot path.

One block-manager process per store (memory://, SQLite FULL), two pools of N sequences each,
one decode Step (every append sent, the previous step reported) per pool per round,
interleaved (alternating which goes first): pool A's Steps carry a request id only, pool B's
carry a client session (number + ack, as the client library sends them). p50/p99 of each and the ratio B/A, one run.

    .venv/bin/python bench/bench_sessions.py [--seqs 256] [--iters 400]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_service import BS, _decode_step, bm_server  # noqa: E402
from block_manager.client import BlockManagerClient  # noqa: E402
from pagedkv.stats import percentile  # noqa: E402
from pagedkv.v1 import block_manager_pb2 as pb  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402


def _admit(c: BlockManagerClient, pool: str, seq_ids: list[str], iters: int) -> int:
    reg = c.register_node(pool, len(seq_ids) * ((BS + iters + 40) // BS + 3) + 16, block_size=BS)
    st = c.step()
    for i, sid in enumerate(seq_ids):
        st.allocate(sid, pool, [i % 97] * (BS + i % BS))
    for info in st.commit().steps.values():
        c.report(info, True)
    c.flush_reports()
    return reg.epoch


def run(database_url: str, n: int, iters: int) -> dict[str, float]:
    with bm_server(database_url, PAGEDKV_SQLITE_SYNCHRONOUS="FULL") as (target, _):
        with BlockManagerClient(target, scheduler_id="bench") as c, grpc.insecure_channel(target) as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            seqs = {p: [f"{p}-{i}" for i in range(n)] for p in ("plain", "session")}
            epochs = {p: _admit(c, p, ids, iters) for p, ids in seqs.items()}
            sid = stub.OpenSession(pb.OpenSessionRequest(client_name="bench")).session_id
            last = {p: 0 for p in seqs}
            lat: dict[str, list[float]] = {p: [] for p in seqs}
            for k in range(iters + 10):
                for p in (("plain", "session") if k % 2 else ("session", "plain")):   # alternate who goes first
                    req = _decode_step(p, epochs[p], seqs[p], k, last[p])
                    if p == "session":
                        req.session.session_id, req.session.seq, req.session.acked = sid, k + 1, k + 1
                    t0 = time.perf_counter()
                    resp = stub.Step(req, timeout=30)
                    dt = time.perf_counter() - t0
                    if resp.errors:
                        raise RuntimeError(f"step failed: {resp.errors[0]}")
                    if resp.steps:
                        last[p] = resp.steps[0].step_id
                    if k >= 10:
                        lat[p].append(dt)
    row = {f"{p}_p{q}_ms": 1e3 * percentile(lat[p], q) for p in seqs for q in (50, 99)}
    row["ratio_p50"] = row["session_p50_ms"] / row["plain_p50_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--iters", type=int, default=400)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sessions-"))
    for name, url in (("memory://", "memory://"), ("sqlite FULL", f"sqlite:///{tmp / 'bm.db'}")):
        r = run(url, args.seqs, args.iters)
        print(
            f"{name:12s} {args.seqs} seqs  request id only p50 {r['plain_p50_ms']:.3f} p99 {r['plain_p99_ms']:.3f} ms"
            f" | session p50 {r['session_p50_ms']:.3f} p99 {r['session_p99_ms']:.3f} ms"
            f" | ratio p50 {r['ratio_p50']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
