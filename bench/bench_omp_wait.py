"""What a parallel region costs a CPU node by OpenMP wait policy (issue 21, services vs embedded).

torch's matmuls run as OpenMP (libgomp) parallel regions. With libgomp's default its workers spin
a few ms after a region, so the next one starts at once (the embedded engine: torch is loaded in
the user's process with the default); with `OMP_WAIT_POLICY=PASSIVE` (for crowded hosts;
`compute-node serve` spins briefly by default, `GOMP_SPINCOUNT=10000`) they sleep, and every
region pays a wake-up. This measures, each mode in a fresh process (libgomp reads the policy
once), alternating `--repeats` times:

- one GEMM of a decode step of the SmolLM-135M shape (`--rows` x 576 @ 576 x 960: the fused QKV
  projection at batch 8), median µs per call over `--calls` calls;
- the 30 layers' 4 GEMMs (QKV, O, gate+up, down: 120 regions) at `--rows` rows, median ms;

in three modes: `spin` (libgomp's default, 2 threads), `passive` (2 threads), `passive, 1 thread`
(`torch.set_num_threads(1)`: no team, nothing to wake; what a passive node does for decode-sized
steps, compute_node/service/dense_threads.py). Medians per mode over the repetitions; print
the load average, the host is shared.

    .venv/bin/python bench/bench_omp_wait.py [--repeats 3] [--rows 8] [--calls 400]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = {"spin": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "passive, 1 thread": {"OMP_WAIT_POLICY": "PASSIVE"}}
H, QKV, INTER = 576, 960, 1536


def child(mode: str, rows: int, calls: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    if mode == "passive, 1 thread":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    x, w = torch.randn(rows, H), torch.randn(QKV, H)
    layers = [(torch.randn(QKV, H), torch.randn(H, H), torch.randn(2 * INTER, H), torch.randn(H, INTER))
              for _ in range(30)]

    def stack() -> None:
        h = x
        for qkv, o, gate_up, down in layers:
            a = F.linear(h, qkv)
            h = F.linear(a[:, :H], o) + h
            g = F.linear(h, gate_up)
            h = F.linear(F.silu(g[:, :INTER]) * g[:, INTER:], down) + h

    with torch.inference_mode():
        for _ in range(50):
            F.linear(x, w)
        per_call = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(calls // 5):
                F.linear(x, w)
            per_call.append(1e6 * (time.perf_counter() - t) / (calls // 5))
        stack()
        stacks = []
        for _ in range(5):
            t = time.perf_counter()
            stack()
            stacks.append(1e3 * (time.perf_counter() - t))
    return {"gemm_us": statistics.median(per_call), "layers_ms": statistics.median(stacks),
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.calls)))
        return
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    loads = []
    for rep in range(args.repeats):
        for mode in (list(MODES) if rep % 2 == 0 else list(reversed(MODES))):
            loads.append(os.getloadavg()[0])
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--rows", str(args.rows), "--calls",
                                  str(args.calls)], env={**base, **MODES[mode]}, capture_output=True, text=True,
                                 check=True)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# bench_omp_wait  {args.rows} rows, {os.cpu_count()} cores, {args.repeats} alternating repetitions; "
          f"load average 1 min {min(loads):.1f}-{max(loads):.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| mode | torch threads | GEMM µs per call (runs) | p50 | 30 layers x 4 GEMMs ms (runs) | p50 |")
    print("|---|---|---|---|---|---|")
    for mode, rs in results.items():
        g = [r["gemm_us"] for r in rs]
        s = [r["layers_ms"] for r in rs]
        print(f"| {mode} | {rs[0]['threads']:.0f} | {' '.join(f'{v:.0f}' for v in g)} | {statistics.median(g):.0f} | "
              f"{' '.join(f'{v:.1f}' for v in s)} | {statistics.median(s):.1f} |")


if __name__ == "__main__":
    main()
