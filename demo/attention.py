"""`pagedkv-demo --mode services`: the pair as real processes, a serving workload through them.

Starts the block manager and both compute nodes from docker-compose.yml as local processes
(`demo.localstack`: embedded SQLite in a temp volume), drives the demo trace through them
with `demo.serving.ServingDriver` (batched Route → one Step RPC per scheduler step through the
client's step helper → Forward on the owning node carrying that node's PoolStep; every
sequence's outputs checked against float64 every step), triggers one admin defrag midway
(its moves ride in the next steps), with `--swap-every N` swaps a few running sequences out
to the nodes' host tier every N steps and back at the next such step (docs/tiers.md), prints
the report and writes the SVG plot (`args.plot`, already checked by `demo.check_plot_path`:
the working directory's `pagedkv-demo.svg` unless `--plot` says otherwise). Everything it
started is stopped on the way out, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from block_manager.trace.format import AppendOp, parse_trace
from block_manager.trace.generate import TraceConfig, generate_trace
from demo.localstack import LocalStack
from demo.serving import ServingDriver
from demo.serving_report import plot, render

NODES = ("compute-node-0", "compute-node-1")


def services_trace_config(num_requests: int, seed: int) -> TraceConfig:
    """The demo mix, with outputs short enough that CPU attention finishes in minutes."""
    return TraceConfig(
        num_requests=num_requests, seed=seed,
        num_system_prompts=3, system_prompt_len=192, shared_prompt_fraction=0.6,
        prompt_len_min=32, prompt_len_max=512, output_len_min=16, output_len_max=256,
        parallel_n=4, parallel_fraction=0.2, arrival_rate=1.0, max_running=48, num_tenants=2,
    )


def run(args: argparse.Namespace) -> int:
    console = Console()
    cfg = services_trace_config(args.requests, args.seed)
    ops = parse_trace(list(generate_trace(cfg)))
    num_steps = sum(isinstance(op, AppendOp) for op in ops)
    env = {"PAGEDKV_CN_NUM_BLOCKS": str(args.node_blocks), "PAGEDKV_LOG_LEVEL": "WARNING"}
    swap_every = getattr(args, "swap_every", 0)
    if swap_every:   # forced swaps need a host tier under each node's pool (`--host-kv-memory` bytes)
        env["PAGEDKV_CN_HOST_KV_MEMORY"] = str(args.host_kv_memory)
    with tempfile.TemporaryDirectory(prefix="pagedkv-demo-") as tmp, \
            LocalStack(Path(tmp), interp_env=env) as stack:
        console.print(f"starting block manager + {len(NODES)} compute nodes from docker-compose.yml ...")
        t0 = time.perf_counter()
        stack.up(["block-manager", *NODES])
        console.print(f"stack healthy in {time.perf_counter() - t0:.1f} s "
                      f"(block manager {stack.address('block-manager')}, "
                      + ", ".join(f"{n} {stack.address(n)}" for n in NODES) + ")")
        driver = ServingDriver(
            stack.address("block-manager"),
            {f"node-{i}": stack.address(n) for i, n in enumerate(NODES)},
            num_heads=args.num_heads, max_model_len=cfg.prompt_len_max + cfg.output_len_max,
            check_every=args.check_every, seed=args.seed, swap_every=swap_every,
        )
        try:
            with Progress(TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                task = progress.add_task("steps", total=num_steps)
                report = driver.run(ops, on_step=lambda _: progress.advance(task),
                                    defrag_at_step=num_steps // 2)
        finally:
            driver.close()
        fsck = stack_fsck(stack)
    render(report, console, title=f"pagedkv demo (services) — {cfg.num_requests} requests, "
                                  f"{num_steps} steps, 2 nodes x {args.node_blocks} blocks")
    console.print(f"fsck after the run: {'clean' if not fsck else fsck}")
    path = plot(report, Path(args.plot))
    console.print(f"plot: {path}")
    return 0 if report.check_failures == 0 and not fsck else 1


def stack_fsck(stack: LocalStack) -> list[str]:
    from block_manager.client.admin import AdminClient

    with AdminClient(stack.address("block-manager")) as admin:
        return list(admin.fsck().get("problems", []))
