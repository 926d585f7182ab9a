"""Micro-benchmark of the block manager core, in-process.

Prints batched `append_slots` latency for a decode step of N sequences (1 token each,
with token ids so full blocks get hashed), p50/p99 in µs over many steps, and
allocate/free throughput. Numbers only; nothing is asserted.

Sequences start at staggered prompt lengths (as in a running batch, so about 1/block_size
of them cross a block boundary per step); `--aligned` makes every sequence cross at the
same step, the worst case. Wall time includes being descheduled on a shared machine; CPU
time (process CPU clock) does not, so both are printed.

    .venv/bin/python bench/bench_core.py [--seqs 256] [--steps 2000] [--block-size 16] [--aligned]
"""

from __future__ import annotations

import argparse
import statistics
import time

from block_manager.core import AppendRequest, BlockManager
from pagedkv.stats import percentile


def bench_append(
    num_seqs: int, num_steps: int, block_size: int, prompt_len: int, aligned: bool
) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each `append_slots` step."""
    blocks_per_seq = (prompt_len + block_size + num_steps) // block_size + 2
    m = BlockManager(watermark=0.0)
    m.add_pool("p", num_seqs * blocks_per_seq, block_size)
    for i in range(num_seqs):
        length = prompt_len if aligned else prompt_len + i % block_size
        m.allocate(f"s{i}", "p", [i] * length)
    seq_ids = [f"s{i}" for i in range(num_seqs)]
    wall: list[float] = []
    cpu: list[float] = []
    for step in range(num_steps):
        batch = [AppendRequest(sid, 1, (step,)) for sid in seq_ids]
        c0 = time.process_time()
        t0 = time.perf_counter()
        m.append_slots(batch)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if m.fsck():
        raise SystemExit("fsck failed after the benchmark")
    return wall, cpu


def bench_alloc_free(num_rounds: int, block_size: int, prompt_len: int) -> tuple[float, float]:
    m = BlockManager(watermark=0.0, enable_prefix_caching=False)
    m.add_pool("p", 4096, block_size)
    ids = [f"r{i}" for i in range(64)]
    t_alloc = t_free = 0.0
    for _ in range(num_rounds):
        t0 = time.perf_counter()
        for sid in ids:
            m.allocate(sid, "p", num_tokens=prompt_len)
        t1 = time.perf_counter()
        m.free(ids)
        t2 = time.perf_counter()
        t_alloc += t1 - t0
        t_free += t2 - t1
    n = num_rounds * len(ids)
    return n / t_alloc, n / t_free


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--aligned", action="store_true", help="all sequences cross blocks together")
    args = ap.parse_args()
    wall, cpu = bench_append(args.seqs, args.steps, args.block_size, args.prompt_len, args.aligned)
    layout = "aligned" if args.aligned else "staggered"
    print(f"append_slots, batch of {args.seqs} x 1 token, block_size {args.block_size}, {layout}:")
    for name, values in (("wall", wall), ("cpu ", cpu)):
        us = [t * 1e6 for t in values[len(values) // 10 :]]  # drop warm-up
        print(
            f"  {name}: p50 {percentile(us, 50):.0f} µs, p99 {percentile(us, 99):.0f} µs, "
            f"min {min(us):.0f} µs, mean {statistics.fmean(us):.0f} µs over {len(us)} steps"
        )
    a_rate, f_rate = bench_alloc_free(200, args.block_size, 512)
    print(f"allocate (512-token prompt, no hashing): {a_rate:,.0f} seq/s; free: {f_rate:,.0f} seq/s")


if __name__ == "__main__":
    main()
