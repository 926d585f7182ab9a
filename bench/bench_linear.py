"""The model's matmuls alone: plain weights through `F.linear` vs weights packed for oneDNN
(`compute_node.model.linear`), side by side in one run.

One "step" is what a decode or prefill step of a 30-layer SmolLM-135M-shaped model multiplies:
per layer q/k/v (576 -> 960), o (576 -> 576), gate/up (576 -> 3072) and down (1536 -> 576),
then the LM head (576 -> 49152) on the last row, with weights of the real size (540 MB in
float32, so every step streams them from memory as a served model's do), at several row counts.

    .venv/bin/python bench/bench_linear.py [--rows 1,4,8,16,64,512] [--dtypes float32,bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from compute_node.model import linear as dense

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def make_weights(dtype: torch.dtype) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(*s, generator=g) / s[1] ** 0.5).to(dtype) for s in SHAPES] for _ in range(LAYERS)]
    return layers, (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dtype)


def step(x: torch.Tensor, layers: list[list[torch.Tensor]], head: torch.Tensor) -> torch.Tensor:
    for qkv, o, gate_up, down in layers:
        dense.linear(x, qkv)
        x = dense.linear(x, o)
        gate, up = dense.linear(x, gate_up).chunk(2, dim=-1)
        x = dense.linear(gate * up, down)
    return dense.linear(x[-1:], head)


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,64,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not dense.onednn_available():
        raise SystemExit("bench_linear: packed matmuls need x86-64 and a torch build with oneDNN")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_linear: 30 layers of the 135M shape + LM head, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {when}")
    print("| dtype | rows | F.linear ms | packed ms | F.linear / packed |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            layers, head = make_weights(dtype)
            packed = [[dense.pack(w) for w in layer] for layer in layers], dense.pack(head)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
                repeats = args.repeats if rows < 256 else max(2, args.repeats // 2)
                # alternate the two, so both see the same machine
                plain_s, packed_s = [], []
                for _ in range(2):
                    plain_s.append(timed(lambda: step(x, layers, head), repeats))
                    packed_s.append(timed(lambda: step(x, *packed), repeats))
                p, q = min(plain_s), min(packed_s)
                print(f"| {name} | {rows} | {1e3 * p:.1f} | {1e3 * q:.1f} | {p / q:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
