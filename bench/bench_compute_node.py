"""Compute node benchmark (issue 5): a decode step through the real services, CPU backend.

A block manager (`memory://`) and a compute node run as separate processes; this process is
the scheduler. For 1 / 16 / 64 sequences it prefills each sequence's context through the
node, then times decode steps the way a scheduler runs them (one Step to the block manager
through the client library, which answers in-block appends itself, then one Forward of all
sequences carrying the pool's PoolStep, every layer in one request). Per step it records:
- the Forward latency the client sees (round trip, encoding included);
- the node's own breakdown from `ForwardStats` (table fetch / copy ops / write / attention);
- the node→block manager calls the Forward made (the step protocol's claim: none; tables come
  with the steps), and the scheduler's Step RPCs per step (0 when every append stayed in-block).
Service overhead ratio = client-observed Forward latency / time inside the attention kernels.
Numbers only; nothing is asserted.

    .venv/bin/python bench/bench_compute_node.py [--seqs 1,16,64] [--steps 48] [--context 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from block_manager.client import BlockManagerClient  # noqa: E402
from compute_node.client import ComputeNodeClient, SeqInput  # noqa: E402
from demo.localstack import ServiceProcess  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 16, 4, 128, 16
PREFILL_CHUNK = 8   # sequences per prefill Forward (keeps messages ~25 MB)


def wait_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not serving after {timeout_s}s")


def start_services(num_blocks: int, log_dir: Path) -> tuple[str, str, list[ServiceProcess]]:
    env = dict(os.environ, PAGEDKV_LOG_LEVEL="WARNING")
    bm = ServiceProcess.start(
        [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url", "memory://"],
        workdir=log_dir, name="bm", cwd=REPO,
        env=dict(env, PAGEDKV_BLOCK_SIZE=str(BLOCK_SIZE), PAGEDKV_WATERMARK="0", PAGEDKV_DEFRAG__ENABLED="false"),
    )
    cn_env = dict(
        env, PAGEDKV_CN_DEVICE="cpu", PAGEDKV_CN_GEOMETRY__NUM_LAYERS=str(LAYERS),
        PAGEDKV_CN_GEOMETRY__NUM_KV_HEADS=str(KV_HEADS), PAGEDKV_CN_GEOMETRY__HEAD_DIM=str(HEAD_DIM),
        PAGEDKV_CN_GEOMETRY__DTYPE="float16", PAGEDKV_CN_BLOCK_SIZE=str(BLOCK_SIZE),
    )
    cn = ServiceProcess.start(
        [sys.executable, "-m", "compute_node.service.cli", "serve", "--listen", "127.0.0.1:0", "--block-manager",
         bm.address, "--node-id", "bench-node", "--num-blocks", str(num_blocks)],
        workdir=log_dir, name="cn", cwd=REPO, env=cn_env,
    )
    wait_serving(bm.address, bm.proc)
    wait_serving(cn.address, cn.proc)
    return bm.address, cn.address, [cn, bm]


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float16)


def run(num_seqs: int, steps: int, context: int, bm: BlockManagerClient, node: ComputeNodeClient) -> dict:
    """Prefill, then decode steps the way a scheduler runs them: one Step (the client answers
    in-block appends itself), one Forward carrying the pool's PoolStep, the report next step."""
    rng = np.random.default_rng(num_seqs)
    ids = [f"n{num_seqs}-s{i}" for i in range(num_seqs)]
    lengths: dict[str, int] = {}
    layers = list(range(LAYERS))

    def forward(step_result: object, seqs: list[SeqInput]) -> object:
        info = step_result.steps.get("bench-node")   # type: ignore[attr-defined]
        out = node.forward(seqs, layers=layers, steps=[info.message] if info is not None else [])
        if info is not None:
            bm.report(info, True)
        return out

    # Prefill: staggered lengths so ~1/BLOCK_SIZE of the sequences cross a block per step,
    # as in a running batch.
    for start in range(0, num_seqs, PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        st = bm.step()
        for j, s in enumerate(chunk):
            st.allocate(s, "bench-node", num_tokens=context + (start + j) % BLOCK_SIZE)
        res = st.commit()
        seqs = []
        for s in chunk:
            n = res.allocations[s].num_tokens   # type: ignore[union-attr]
            lengths[s] = n
            seqs.append(SeqInput(s, n, rand(rng, LAYERS, n, HEADS, HEAD_DIM), rand(rng, LAYERS, n, KV_HEADS, HEAD_DIM),
                                 rand(rng, LAYERS, n, KV_HEADS, HEAD_DIM)))
        forward(res, seqs)

    rows = []
    for _ in range(steps):
        st = bm.step()
        for s in ids:
            st.append(s, num_new_tokens=1)
        t_step = time.perf_counter()
        res = st.commit()
        step_s = time.perf_counter() - t_step
        seqs = []
        for s in ids:
            lengths[s] += 1
            seqs.append(SeqInput(s, lengths[s], rand(rng, LAYERS, 1, HEADS, HEAD_DIM),
                                 rand(rng, LAYERS, 1, KV_HEADS, HEAD_DIM), rand(rng, LAYERS, 1, KV_HEADS, HEAD_DIM)))
        t0 = time.perf_counter()
        out = forward(res, seqs)
        latency = time.perf_counter() - t0
        st_ = out.stats   # type: ignore[attr-defined]
        rows.append((latency, st_.total_s, st_.table_fetch_s, st_.copy_ops_s, st_.write_s, st_.attention_s,
                     st_.num_block_manager_rpcs, st_.kv_bytes_read, res.num_rpcs, step_s))
    bm.free(ids)
    warm = rows[4:]   # the first steps still pay one-off costs (allocator, caches)
    med = [statistics.median(r[i] for r in warm) for i in range(6)]
    return {
        "seqs": num_seqs,
        "forward_ms": med[0] * 1e3,
        "node_total_ms": med[1] * 1e3,
        "table_fetch_ms": med[2] * 1e3,
        "copy_ops_ms": med[3] * 1e3,
        "write_ms": med[4] * 1e3,
        "attention_ms": med[5] * 1e3,
        "overhead_ratio": med[0] / med[5],
        "rpcs_per_forward": statistics.mean(r[6] for r in warm),
        "forwards_with_rpc": sum(1 for r in warm if r[6]) / len(warm),
        "kv_mb_per_step": statistics.mean(r[7] for r in warm) / 1e6,
        "kv_gbps": statistics.median(r[7] / r[5] for r in warm) / 1e9,
        "step_rpcs_per_step": statistics.mean(r[8] for r in warm),
        "step_ms": statistics.median(r[9] for r in warm) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,16,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    sizes = [int(x) for x in args.seqs.split(",")]
    blocks_per_seq = (args.context + BLOCK_SIZE + args.steps) // BLOCK_SIZE + 2
    num_blocks = sum(sizes) * blocks_per_seq
    with tempfile.TemporaryDirectory() as tmp:
        bm_addr, cn_addr, procs = start_services(num_blocks, Path(tmp))
        try:
            with BlockManagerClient(bm_addr, timeout_s=60) as bm, ComputeNodeClient(cn_addr, timeout_s=300) as node:
                bm.tracker.set_block_size("bench-node", BLOCK_SIZE)
                print(f"geometry: {LAYERS} layers, {HEADS} q heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
                      f"fp16, block {BLOCK_SIZE}, context ~{args.context}, {args.steps} steps (first 4 dropped), "
                      f"load {os.getloadavg()[0]:.1f}")
                print(
                    "| seqs | Forward (client) ms | node total ms | table fetch ms | copy ops ms | write ms "
                    "| attention ms | overhead ratio | node→BM RPCs per Forward | Forwards with a node→BM RPC "
                    "| Step RPCs per step | Step ms | KV MB/step | KV GB/s |"
                )
                print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
                for n in sizes:
                    r = run(n, args.steps, args.context, bm, node)
                    print(
                        f"| {r['seqs']} | {r['forward_ms']:.2f} | {r['node_total_ms']:.2f} | {r['table_fetch_ms']:.3f} "
                        f"| {r['copy_ops_ms']:.3f} | {r['write_ms']:.3f} | {r['attention_ms']:.2f} "
                        f"| {r['overhead_ratio']:.2f} | {r['rpcs_per_forward']:.3f} | {r['forwards_with_rpc']:.0%} "
                        f"| {r['step_rpcs_per_step']:.2f} | {r['step_ms']:.2f} "
                        f"| {r['kv_mb_per_step']:.1f} | {r['kv_gbps']:.2f} |",
                        flush=True,
                    )
        finally:
            for p in procs:
                p.stop()


if __name__ == "__main__":
    main()
