"""The model's matmuls alone: plain weights through `F.linear`, weights packed for oneDNN and
weights packed into the panel GEMM's layout (`compute_node.model.linear`, `kernels.cpu.gemm`),
side by side in one run.

One "step" is what a decode or prefill step of a 30-layer model multiplies: per layer q/k/v,
o, gate/up and down, then the LM head on the last row, with weights of the real size (540 MB
for SmolLM-135M's shape in float32, 2 GB for Qwen2.5-0.5B's, so every step streams them from
memory as a served model's do), at several row counts. The backends run alternated, `--rounds`
times each, so all see the same machine; each cell is the fastest of its rounds, wall time and
the process's CPU time (both cores' worth: on a shared host the CPU time is the steadier one).

    .venv/bin/python bench/bench_linear.py [--shape smollm-135m|qwen2.5-0.5b] [--rows 1,4,8,16,64,512]
        [--backends plain,onednn,panels] [--dtypes float32,bfloat16] [--repeats 5] [--rounds 3] [--no-head]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numba
import torch

from compute_node.model import linear as dense

# hidden, intermediate, q/k/v output, vocab, layers
SHAPES = {"smollm-135m": (576, 1536, 960, 49152, 30), "qwen2.5-0.5b": (896, 4864, 1152, 151936, 24)}
PACKERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "plain": lambda w: w, "onednn": dense.pack_onednn, "panels": dense.pack_panels}

Layer = list[torch.Tensor]


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    hidden, inter, qkv, _, _ = SHAPES[shape]
    return [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


def make_weights(shape: str, dtype: torch.dtype) -> tuple[list[Layer], torch.Tensor]:
    hidden, _, _, vocab, num_layers = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(*s, generator=g) / s[1] ** 0.5).to(dtype) for s in layer_shapes(shape)]
              for _ in range(num_layers)]
    return layers, (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)


def step(x: torch.Tensor, layers: list[Layer], head: torch.Tensor | None) -> torch.Tensor:
    for qkv, o, gate_up, down in layers:
        dense.linear(x, qkv)
        x = dense.linear(x, o)
        gate, up = dense.linear(x, gate_up).chunk(2, dim=-1)
        x = dense.linear(gate * up, down)
    return x if head is None else dense.linear(x[-1:], head)


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(wall s, process CPU s) of the fastest of `repeats` calls, after one warm-up call."""
    fn()
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm-135m", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,4,8,16,64,512")
    ap.add_argument("--backends", default="plain,onednn,panels")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-head", action="store_true", help="the layers only (a decode step's dense part)")
    args = ap.parse_args()
    backends = args.backends.split(",")
    if not dense.onednn_available() and "onednn" in backends:
        raise SystemExit("bench_linear: oneDNN packing needs x86-64 and a torch build with oneDNN")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_linear: {args.shape}, {'layers only' if args.no_head else 'layers + LM head'}, torch threads "
          f"{torch.get_num_threads()}, Numba threads {numba.get_num_threads()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}, panels preferred here: {dense.panels_preferred()}, {when}")
    print("| dtype | rows | " + " | ".join(f"{b} ms (CPU ms)" for b in backends) + " | "
          + " | ".join(f"{backends[0]} / {b}" for b in backends[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(backends) - 1))
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            layers, head = make_weights(args.shape, dtype)
            sets = {}
            for b in backends:
                if b == "panels" and dtype != torch.float32:
                    continue
                packed_head = None if args.no_head else PACKERS[b](head)
                sets[b] = [[PACKERS[b](w) for w in layer] for layer in layers], packed_head
            for rows in map(int, args.rows.split(",")):
                hidden = layer_shapes(args.shape)[1][0]
                x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(dtype)
                repeats = args.repeats if rows < 256 else max(2, args.repeats // 2)
                best: dict[str, tuple[float, float]] = {b: (float("inf"), float("inf")) for b in sets}
                for _ in range(args.rounds):   # alternated, so all see the same machine
                    for b, (packed_layers, packed_head) in sets.items():
                        wall, cpu = timed(lambda: step(x, packed_layers, packed_head), repeats)
                        best[b] = (min(best[b][0], wall), min(best[b][1], cpu))
                cells = [f"{1e3 * best[b][0]:.1f} ({1e3 * best[b][1]:.0f})" if b in best else "-" for b in backends]
                first = best.get(backends[0])
                ratios = [f"{first[0] / best[b][0]:.2f}x ({first[1] / best[b][1]:.2f}x)" if first and b in best else "-"
                          for b in backends[1:]]
                print(f"| {name} | {rows} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
