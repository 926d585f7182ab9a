"""Per-layer CPU attention on the step shapes of `bench/bench_vs_vllm.py`'s workloads (issue 42).

Each case is one model step's attention as the engine builds it (block size 16, float32 caches,
block tables drawn from a shuffled pool, prompts of the shared workload pointing at the same
prefix blocks), run through `StepAttention.run` for one layer. The prefill paths compared:
`sdpa` (torch's SDPA after gathering each sequence's K/V, `prefill_sdpa.py`), `tiles` (the
Numba tile kernel, `attend.prefill_tile`) and `flash` (the AVX2 register-tile kernel,
`prefill_flash.py`). Decode-only cases compare `per-seq` (the fused call's decode items, one
per sequence and KV head) with `cascade` (`decode_cascade.py`: blocks shared by several
sequences read once for all of them, through the same register tiles).
Paths alternate within each repeat; printed: median wall ms per layer over `--repeats` runs of
`--calls` calls each (in brackets the process's CPU ms, every thread summed: the steadier measure
when other processes share the cores), for each shape (smollm-135m: 9 / 3 heads, qwen2.5-0.5b: 14 / 2, head dim
64), and the layer count to turn it into a step's share.

    .venv/bin/python bench/bench_cpu_attention.py [--shapes smollm-135m,qwen2.5-0.5b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.step import KvBits, StepAttention

BLOCK = 16
HEAD_DIM = 64
SHAPES = {"smollm-135m": (9, 3, 30), "qwen2.5-0.5b": (14, 2, 24)}   # heads, KV heads, layers


@dataclass(slots=True)
class Case:
    """One step: prefill sequences as (context after the step, query rows) and decode contexts;
    `shared` tokens at the start of every sequence point at the same blocks."""

    name: str
    prefill: list[tuple[int, int]]
    decode: list[int]
    shared: int = 0


def cases(rng: random.Random) -> list[Case]:
    own = [rng.randint(16, 64) for _ in range(23)]
    batch = [rng.randint(16, 512) for _ in range(8)]
    return [
        Case("shared prefill (296 + 23 x 16-64 after 256 cached)",
             [(296, 296)] + [(256 + n, n) for n in own], [], 256),
        Case("batch prefill (8 prompts of 16-512)", [(n, n) for n in batch], []),
        Case("long prefill (1536 tokens, then 512 after 1536)", [(1536, 1536), (2048, 512)], []),
        Case("shared decode (24 x ~300, 256 shared)", [], [256 + n + rng.randint(0, 64) for n in own[:24]] +
             [300], 256),
        Case("batch decode (32 x 16-576)", [], [rng.randint(16, 576) for _ in range(32)]),
    ]


def build(case: Case, heads: int, kv_heads: int, sdpa: bool | None, flash: bool | None,
          rng: np.random.Generator, serial: bool | None = None, cascade: bool | None = None) -> Callable[[], object]:
    lens = [ctx for ctx, _ in case.prefill] + case.decode
    shared_blocks = case.shared // BLOCK
    own_blocks = [-(-n // BLOCK) - shared_blocks for n in lens]
    num_blocks = shared_blocks + sum(own_blocks) + 1
    pool = rng.permutation(num_blocks).astype(np.int32)
    prefix, cursor = pool[:shared_blocks], shared_blocks
    tables = np.zeros((len(lens), max(-(-n // BLOCK) for n in lens)), np.int32)
    for i in range(len(lens)):
        row = np.concatenate([prefix, pool[cursor:cursor + own_blocks[i]]])
        cursor += own_blocks[i]
        tables[i, :len(row)] = row
    kc = torch.randn(num_blocks, kv_heads, BLOCK, HEAD_DIM)
    vc = torch.randn(num_blocks, kv_heads, BLOCK, HEAD_DIM)
    num_dec = len(case.decode)
    q_lens = [q for _, q in case.prefill]
    rows = num_dec + sum(q_lens)
    slots = np.full(rows, -1, np.int64)   # K/V already in place: nothing written
    query = torch.randn(rows, heads, HEAD_DIM)
    kv = torch.randn(rows, kv_heads, HEAD_DIM)
    out = torch.empty_like(query)
    n_pre = len(case.prefill)
    kwargs = {}
    if flash is not None:
        kwargs["flash_prefill"] = flash
    step = StepAttention(
        KvBits([kc], [vc]), num_heads=heads, slot_mapping=torch.from_numpy(slots), num_decode_tokens=num_dec,
        decode_block_tables=torch.from_numpy(tables[n_pre:]) if num_dec else None,
        decode_seq_lens=torch.tensor(case.decode, dtype=torch.int32) if num_dec else None,
        prefill_block_tables=torch.from_numpy(tables[:n_pre]) if n_pre else None,
        prefill_seq_lens=torch.tensor([c for c, _ in case.prefill], dtype=torch.int32) if n_pre else None,
        prefill_query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
        if n_pre else None,
        scale=HEAD_DIM ** -0.5, sdpa_prefill=sdpa, serial=serial, cascade_decode=cascade, **kwargs)
    return lambda: step.run(0, query, kv, kv, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm-135m,qwen2.5-0.5b")
    parser.add_argument("--paths", default="sdpa,tiles,flash")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--one-thread", action="store_true",
                        help="every path on one thread (torch too): CPU time per path, no wait on the other core")
    args = parser.parse_args()
    serial = True if args.one_thread else None
    if args.one_thread:
        torch.set_num_threads(1)
    paths = {"sdpa": (True, None), "tiles": (False, None), "flash": (False, True)}
    wanted = [p for p in args.paths.split(",") if p]
    for shape in args.shapes.split(","):
        heads, kv_heads, layers = SHAPES[shape]
        print(f"\n{shape}: {heads} / {kv_heads} heads x {HEAD_DIM}, {layers} layers; ms per layer (median of "
              f"{args.repeats} x {args.calls} calls)")
        for case in cases(random.Random(0)):
            rng = np.random.default_rng(0)
            if case.prefill:
                runs = {p: build(case, heads, kv_heads, *paths[p], rng, serial) for p in wanted}
            else:
                runs = {"per-seq": build(case, heads, kv_heads, None, None, rng, serial, False),
                        "cascade": build(case, heads, kv_heads, None, None, rng, serial, True)}
            times: dict[str, list[float]] = {p: [] for p in runs}
            cpus: dict[str, list[float]] = {p: [] for p in runs}
            for fn in runs.values():
                fn()   # compile / warm
            for _ in range(args.repeats):
                for p, fn in runs.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.calls):
                        fn()
                    times[p].append((time.perf_counter() - t0) / args.calls * 1e3)
                    cpus[p].append((time.process_time() - c0) / args.calls * 1e3)
            cells = "  ".join(f"{p} {statistics.median(t):7.2f} ({statistics.median(cpus[p]):7.2f})"
                              for p, t in times.items())
            print(f"  {case.name:52s} {cells}")


if __name__ == "__main__":
    main()
