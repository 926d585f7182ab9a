"""`pagedkv-demo`: the project's main job.

Modes:
- `services` (default, `demo/services.py`): a real model (`--model DIR`, or a small
  random-weight Llama built locally) served by the block manager and two compute nodes as
  processes, through the continuous-batching engine; reports tokens/s, time to first token,
  inter-token latency, KV blocks against contiguous preallocation, prefix hits, CoW copies,
  preemptions, and how many greedy completions equal the reference; writes a plot.
- `attention` (`demo/attention.py`): the same stack fed synthetic Q/K/V, every
  sequence's attention output checked against float64 every step (the attention-level path).
- `core`: the workload replayed through the in-process block manager core: what paging buys
  (waste, concurrency at equal memory, prefix hits, CoW, evictions, append latency).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from block_manager.trace.generate import TraceConfig, write_trace
from block_manager.trace.replay import ReplayReport, replay
from pagedkv.cli import ArgumentParser, catch_ctrl_c, error_line

DEFAULT_PLOT = "pagedkv-demo.svg"
EXIT_INTERRUPTED = 130


class PlotPathError(ValueError):
    """`--plot` names a place the SVG cannot be written to."""


@dataclass(slots=True)
class DemoResult:
    """What one demo mode measured; the report renders only this."""

    mode: str
    trace: TraceConfig
    num_ops: int
    report: ReplayReport
    gen_s: float


def demo_trace_config(num_requests: int, seed: int) -> TraceConfig:
    """The demo workload: a chat-like mix with shared prompts and some parallel sampling."""
    return TraceConfig(
        num_requests=num_requests,
        seed=seed,
        num_system_prompts=4,
        system_prompt_len=384,
        shared_prompt_fraction=0.6,
        prompt_len_min=50,
        prompt_len_max=1000,
        output_len_min=50,
        output_len_max=2000,
        parallel_n=4,
        parallel_fraction=0.2,
        arrival_rate=2.0,
        max_running=128,
        num_tenants=2,
    )


def run_core_mode(args: argparse.Namespace, workdir: Path) -> DemoResult:
    config = demo_trace_config(args.requests, args.seed)
    trace_path = workdir / "demo_trace.jsonl"
    start = time.perf_counter()
    num_ops = write_trace(trace_path, config)
    gen_s = time.perf_counter() - start
    report = replay(
        trace_path,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        watermark=args.watermark,
        max_output_len=config.output_len_max,
    )
    return DemoResult("core", config, num_ops, report, gen_s)


MODES: dict[str, Callable[[argparse.Namespace, Path], DemoResult]] = {"core": run_core_mode}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_report(result: DemoResult, console: Console) -> None:
    """Print the demo report: workload, memory, sharing and latency tables."""
    r, cfg = result.report, result.trace
    console.print(
        f"[bold]pagedkv demo[/bold] (mode: {result.mode}) — {cfg.num_requests} requests, "
        f"{result.num_ops} trace ops, pool {r.num_blocks} blocks x {r.block_size} slots"
    )
    memory = Table(title="KV memory: paged vs contiguous preallocation")
    memory.add_column("metric")
    memory.add_column("paged", justify="right")
    memory.add_column("contiguous", justify="right")
    memory.add_row("peak KV blocks", f"{r.peak_used_blocks}", f"{r.contiguous_baseline_blocks}")
    memory.add_row("mean KV blocks", f"{r.mean_used_blocks:.0f}", f"{r.contiguous_mean_blocks:.0f}")
    memory.add_row("concurrency at equal memory", f"{r.concurrency_gain:.2f}x", "1.00x")
    memory.add_row("  ... vs an exact-length oracle", f"{r.concurrency_gain_exact:.2f}x", "1.00x")
    memory.add_row("waste (allocated - tokens) / allocated", _pct(r.waste_ratio), _pct(r.contiguous_waste_ratio))
    memory.add_row("peak / mean running sequences", f"{r.peak_concurrency} / {r.mean_concurrency:.0f}", "")
    console.print(memory)
    console.print(
        f"contiguous = every sequence reserves prompt + max output ({cfg.output_len_max}) slots "
        "at admission; forked samples each reserve their own region. The oracle row reserves "
        "each sequence's exact final length instead (the best contiguous can do)."
    )

    sharing = Table(title="Sharing and pressure")
    sharing.add_column("metric")
    sharing.add_column("value", justify="right")
    sharing.add_row(
        "prefix cache hit tokens / queried",
        f"{r.prefix_hit_tokens} / {r.prefix_query_tokens} ({_pct(r.prefix_hit_rate)})",
    )
    sharing.add_row("copy-on-write copies", f"{r.cow_copies}")
    sharing.add_row("evictions", f"{r.evictions}")
    sharing.add_row("rejected / preempted / skipped", f"{r.rejected} / {r.preempted} / {r.skipped}")
    console.print(sharing)

    latency = Table(title="Core latency (in-process)")
    latency.add_column("metric")
    latency.add_column("value", justify="right")
    latency.add_row("append step p50 / p99", f"{r.append_step_p50_us:.0f} us / {r.append_step_p99_us:.0f} us")
    latency.add_row("mean sequences per append step", f"{r.mean_append_batch:.0f}")
    latency.add_row("trace ops per second (core time)", f"{r.ops_per_s:,.0f}")
    latency.add_row("trace generation / replay wall", f"{result.gen_s:.2f} s / {r.wall_s:.2f} s")
    console.print(latency)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pagedkv-demo", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run pagedkv end to end on this machine and report what paging buys.\n\n"
                       + "\n".join(__doc__.splitlines()[2:]).replace("`", ""))
    p.add_argument("--mode", choices=["services", "attention", *sorted(MODES)], default="services",
                   help="services: a model served by the block manager + two compute nodes as processes (default); "
                        "attention: the same stack fed synthetic Q/K/V (the attention-level test path); "
                        "core: in-process block manager replay")
    p.add_argument("--model", default=None,
                   help="services: a Hugging Face model directory (Llama/Qwen2/Qwen3); default: build a small "
                        "random-weight Llama locally")
    p.add_argument("--max-batched-tokens", type=int, default=256,
                   help="services: new tokens per engine step (longer prompts are prefilled in chunks)")
    p.add_argument("--requests", type=int, default=None,
                   help="number of requests (default: 48 services, 120 attention, 400 core)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--num-blocks", type=int, default=8192, help="blocks in the pool")
    p.add_argument("--block-size", type=int, default=16, help="token slots per block")
    p.add_argument("--watermark", type=float, default=0.01, help="admission watermark")
    p.add_argument("--node-blocks", type=int, default=2048, help="services: blocks per compute node")
    p.add_argument("--host-kv-memory", type=int, default=256 << 20,
                   help="services (and attention with --swap-every): bytes of host KV tier per compute node "
                        "(swaps, offloaded prefixes; 0: none)")
    p.add_argument("--num-heads", type=int, default=8, help="services: query heads (GQA over the nodes' KV heads)")
    p.add_argument("--swap-every", type=int, default=0, metavar="N",
                   help="attention: every N steps swap a few running sequences out to the nodes' host tier and "
                        "the previous ones back in (0: never)")
    p.add_argument("--check-every", type=int, default=1,
                   help="services: check every sequence's outputs every N steps (0: never)")
    p.add_argument("--max-checked", type=int, default=64,
                   help="services: compare at most this many greedy requests with transformers (default 64)")
    p.add_argument("--plot", default=DEFAULT_PLOT,
                   help=f"services: where to write the SVG plot (default: {DEFAULT_PLOT} in the working directory)")
    return p


def check_plot_path(text: str) -> Path:
    """The plot's path, checked before the run (not after minutes of serving): an existing,
    writable directory and a file name ending in .svg.
    `PlotPathError` with a one-line reason otherwise."""
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if path.is_dir():
        raise PlotPathError(f"--plot {text}: is a directory; give a file name such as {path / DEFAULT_PLOT}")
    if not path.parent.is_dir():
        raise PlotPathError(f"--plot {text}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise PlotPathError(f"--plot {text}: directory {path.parent} is not writable")
    if path.suffix.lower() != ".svg":
        raise PlotPathError(f"--plot {text}: unsupported image type {path.suffix or '(none)'!r}; use .svg")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    catch_ctrl_c()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # everything started was stopped on the way out (context managers)
        print("pagedkv-demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests is None:
        args.requests = {"services": 48, "attention": 120}.get(args.mode, 400)
    if min(args.requests, args.num_blocks, args.block_size, args.node_blocks, args.num_heads,
           args.max_batched_tokens) < 1 or args.swap_every < 0:
        print("pagedkv-demo: error: --requests, --num-blocks, --block-size, --node-blocks, --num-heads and "
              "--max-batched-tokens must be >= 1, --swap-every >= 0", file=sys.stderr)
        return 2
    if args.mode in ("services", "attention"):
        try:
            args.plot = check_plot_path(args.plot)
        except PlotPathError as exc:
            print(f"pagedkv-demo: error: {exc}", file=sys.stderr)
            return 2
        if args.mode == "services" and args.model:
            from compute_node.model.config import ModelConfig
            from compute_node.model.errors import ModelLoadError

            try:       # before anything starts: the stack would load it in every node
                ModelConfig.from_dir(args.model)
            except ModelLoadError as exc:
                print(error_line("pagedkv-demo", f"--model: {exc}", "a Llama / Qwen2 / Qwen3 Hugging Face "
                                 "directory; without --model the demo builds a small one"), file=sys.stderr)
                return 2
        if args.mode == "attention":
            from demo.attention import run
        else:
            from demo.services import run
        return run(args)
    with tempfile.TemporaryDirectory(prefix="pagedkv-demo-") as tmp:
        result = MODES[args.mode](args, Path(tmp))
    render_report(result, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
