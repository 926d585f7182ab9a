"""Core speed: trace replay throughput and one batched `append_slots` for 256 sequences.

    .venv/bin/python bench/bench_replay.py [--requests 1000] [--steps 2000]

Prints markdown tables. Times are in-process (no gRPC); the machine is shared, so look at
p50 first and treat p99 as noisy.
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

from block_manager.core.manager import BlockManager
from block_manager.core.types import AppendRequest, PoolId, SeqId
from block_manager.trace.generate import TraceConfig, write_trace
from block_manager.trace.replay import replay
from pagedkv.stats import percentile


def bench_replay(num_requests: int, block_size: int) -> None:
    config = TraceConfig(
        num_requests=num_requests,
        seed=1,
        shared_prompt_fraction=0.5,
        parallel_fraction=0.1,
        arrival_rate=4.0,
        max_running=256,
        num_tenants=2,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        num_ops = write_trace(path, config)
        size_mb = path.stat().st_size / 1e6
        report = replay(path, num_blocks=32_768, block_size=block_size)
    print(f"## replay throughput ({num_requests} requests, {num_ops} ops, {size_mb:.1f} MB, block size {block_size})\n")
    print("| ops | core s | wall s | ops/s (core) | mean seqs/step | append step p50 us | p99 us |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {report.ops} | {report.core_s:.2f} | {report.wall_s:.2f} | {report.ops_per_s:,.0f} | "
        f"{report.mean_append_batch:.0f} | {report.append_step_p50_us:.0f} | {report.append_step_p99_us:.0f} |"
    )
    seq_steps = report.mean_append_batch * report.num_append_steps
    print(f"\nsequence-steps appended: {seq_steps:,.0f} ({seq_steps / report.core_s:,.0f} per core second)\n")


def bench_append_256(
    num_seqs: int, num_steps: int, block_size: int, with_tokens: bool
) -> tuple[list[float], list[float]]:
    """Time `append_slots` for `num_seqs` decoding sequences, one token each per step.

    Returns sorted wall and thread-CPU times in microseconds: on a shared machine the CPU
    time shows the cost without waiting for a core."""
    rng = random.Random(0)
    manager = BlockManager(watermark=0.0)
    pool = PoolId("bench")
    max_len = 1000 + num_steps + block_size
    manager.add_pool(pool, num_seqs * (max_len // block_size + 2), block_size)
    seq_ids = [SeqId(f"s{i}") for i in range(num_seqs)]
    for seq_id in seq_ids:
        prompt = [rng.randrange(32_000) for _ in range(rng.randint(50, 1000))]
        manager.allocate(seq_id, pool, prompt)
    wall_us: list[float] = []
    cpu_us: list[float] = []
    for _ in range(num_steps):
        if with_tokens:
            requests = [AppendRequest(s, 1, (rng.randrange(32_000),)) for s in seq_ids]
        else:
            requests = [AppendRequest(s, 1) for s in seq_ids]
        start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        manager.append_slots(requests)
        cpu_us.append((time.thread_time_ns() - cpu_start) / 1000)
        wall_us.append((time.perf_counter_ns() - start) / 1000)
    return sorted(wall_us), sorted(cpu_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}\n")
    if not args.skip_replay:
        bench_replay(args.requests, args.block_size)
    print(f"## batched append_slots, 256 sequences x 1 token, {args.steps} steps, block size {args.block_size}\n")
    print("| token ids | wall p50 us | wall p99 us | CPU p50 us | CPU p99 us | us per sequence (CPU p50) |")
    print("|---|---|---|---|---|---|")
    for with_tokens in (True, False):
        wall, cpu = bench_append_256(256, args.steps, args.block_size, with_tokens)
        label = "given (hashes full blocks)" if with_tokens else "omitted (count only)"
        print(
            f"| {label} | {percentile(wall, 50):.0f} | {percentile(wall, 99):.0f} | {percentile(cpu, 50):.0f} | "
            f"{percentile(cpu, 99):.0f} | {percentile(cpu, 50) / 256:.2f} |"
        )


if __name__ == "__main__":
    main()
