"""GPU check of the Numba CUDA kernels and the engine (run through bench/gpu_check.sh RESULTS_DIR).

What users run, measured in one command under 5 minutes (issue 43 item 4; the review's §4.3
plan, `../shared/reviews/kernels.md`). Phases run in priority order against a global deadline
(`--deadline-s`, default 280 s: with the wheels' install and the imports the command ends near
300 s); each has a time budget; a phase that would not fit is skipped and logged, one that runs
out stops after its current cell. Every result is a JSON line in
RESULTS_DIR/gpu_check.jsonl, flushed as it is measured, and RESULTS_DIR/gpu_check.{json,md} are
rewritten after every phase, so a run stopped at any point keeps what it measured
(`gpu_run.py`). Kernel times are kernel-only (`gpu_timing.py`: a spin kernel ahead of the
start event hides the host), with back-to-back and host µs per launch path beside them.

Phases, with budgets and the GPU time each should take on an H200 (estimated from BENCHMARKS.md
"Kernels — CUDA (H200)": the 2026-12-04 check took 76-105 s, mostly Numba JIT of ~35 variants
at ~3 s each; decode kernels at 0.85-0.94 of a 4.2 TB/s copy; an 8k prefill layer 3.3 ms):

| # | phase | items (§4.3) | what | estimate | budget | skipped if fewer left |
|---|---|---|---|---|---|---|
| 0 | setup | - | device, versions, 4 GiB copy bandwidth | 3 s | 15 s | - |
| 1 | jit | 17 | compile seconds, registers, spills, blocks/SM of 18 variants | 55 s | 75 s | 20 s |
| 2 | correctness | 1 | the float64 matrix (~20 more variants JIT), determinism, node graphs | 55 s | 80 s | 30 s |
| 3 | decode | 2 | B {1,16,64,256} x ctx {512,4096,32768}: direct, graph, SDPA | 15 s | 35 s | 10 s |
| 4 | decode_ab | 3-8 | split counts, shortest split, paging, block 8-64, bf16/d64, ragged | 20 s | 35 s | 10 s |
| 5 | million | 9 | 1M-token decode and a 512-token prefill chunk after it, vs float64 | 8 s | 20 s | 10 s |
| 6 | prefill | 10-11 | 8k prompt fp16/bf16 x d128/d64; chunks 16-512 after 8k/32k, B 1/16 | 15 s | 30 s | 10 s |
| 7 | engine_1b | 14 | bf16 Llama-3.2-1B shape, 128 requests vs transformers; floors | 70 s | 100 s | 60 s |
| 8 | host | 13 | Python µs per launch path (decode API, plan, graph, prefill, write) | 4 s | 10 s | 4 s |
| 9 | step_graph | - | whole-step decode graphs vs eager, teacher-forced, B 64 → 1 (item 3) | 12 s | 25 s | 12 s |
| 10 | prefill_ab | 12 | 8k prefill per prepared kernel version, one process each (if any) | 23 s | 45 s | 15 s |
| 11 | engine_8b | 15 | the same on 4 Llama-3-8B layers (d128), 64 requests | 55 s | 70 s | 50 s |

How the estimates were made: JIT ~2-3 s per variant (18 in phase 1; the correctness matrix's
~17 others: fp32, MHA, MQA, d256, mixed types, reduce, write, copy); the node graph check
~30 s (gpu_check_graphs.py); a timing cell is its allocation (<= 2 x 8.6 GB of randn), <= 30
repetitions of (1 ms spin + kernel) per launch path, as many back to back, and up to 32
graph captures for the small cells: 0.3-1.5 s; the 1M cell 4.3 GB of K/V, a float64 reference
of one KV head and 7 prefill calls of ~55 ms; the engine: a 2.2 GB random model written to disk
(~5 s), LLM start-up with its bf16 d64 graphs (~15 s), 128 requests (~10 s; transformers ~15 s
more), the batch-1 / batch-64 steps (~10 s); one prefill version ~7 s (import, JIT, timing:
the estimate counts 3 prepared versions; more run while the budget lasts); the whole-step graph
check (gpu_check_step_graph.py) a 0.8 GB fp16 model written and loaded (~3 s), a prefill of 64
prompts and 48 decode steps of 8 layers, the graphs' captures (~1 s).

Estimated total 335 s with phase 11, 280 s without (257 s without prepared prefill versions):
phase 11 runs only when the others were quicker than estimated. Prefill versions are prepared
on the host beforehand (`bench/gpu_check_prefill_ab.py prepare COMMIT...`, carried as
`.prefill_ab`). The README's blocks (item 17) stay a separate call:
`PAGEDKV_README_TIMEOUT_S=150 bench/gpu_readme.sh -x`.

`--cpu-smoke`: the same phases and cells with tiny sizes on the CPU, under Numba's simulator
with every kernel launch stubbed out (numbers meaningless; checks not judged): it proves the
script runs end to end before a GPU minute is spent on it. Exit status: 0; 1 when a correctness
check fails (or, with --cpu-smoke, when any cell raises); 2 when no GPU is visible.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The sibling modules import as top-level names, also when this file is loaded by path (tests).
_BENCH_DIR = str(Path(__file__).resolve().parent)
if _BENCH_DIR not in sys.path:
    sys.path.insert(0, _BENCH_DIR)

from gpu_check_log import log  # noqa: E402
from gpu_run import PhaseContext, PhaseResult, PhaseSpec, ResultsLog, Runner, rows_table, write_summary  # noqa: E402
from gpu_targets import judge  # noqa: E402
from gpu_targets import lines as target_lines  # noqa: E402

EXIT_NO_GPU = 2
DEFAULT_DEADLINE_S = 280.0
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results directory (created)")
    p.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help="global deadline in seconds from the start (default %(default)s)")
    p.add_argument("--phases", default="",
                   help="comma-separated phase names to run (default: all, in order)")
    p.add_argument("--skip", default="", help="comma-separated phase names to skip")
    p.add_argument("--max-reps", type=int, default=None, help="timed repetitions per case (cap)")
    p.add_argument("--prefill-ab", type=Path, default=None,
                   help="prepared kernel versions to time (default: .prefill_ab in the repository)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny sizes on the CPU, kernel launches stubbed (see the module doc)")
    p.add_argument("--host-path-cpu", action="store_true",
                   help="no GPU needed: Python cost per call of the three decode entry points\n"
                        "in Numba's simulator with every launch stubbed out (prints, exits)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------
# The simulator with launches stubbed (smoke run, host path on the CPU)
# ------------------------------------------------------------------------------------------


def use_stubbed_simulator() -> None:
    """Numba's CUDA simulator with every kernel launch a no-op: the host path (validation,
    dispatch, plans, graphs, pointers) runs, the kernels do not. Must run before numba loads."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import kernels.cuda
    import kernels.cuda.graph
    import kernels.cuda.plan
    import kernels.cuda.prefill_plan  # noqa: F401 - with the package: every module that launches

    def stub(kernel: Any, grid: Any, threads: int, stream: Any) -> Any:
        return lambda *args: None

    for name, module in list(sys.modules.items()):
        if name.startswith("kernels.cuda") and hasattr(module, "launcher"):
            setattr(module, "launcher", stub)  # noqa: B010 - a module found at run time


def host_path_cpu(calls: int = 2000) -> dict[str, float]:
    """Our Python per decode call, without a GPU: the simulator's arrays stand in for device
    tensors and the kernel launch (and graph replay) is a no-op, so what is timed is
    validation, dispatch, variant lookup, address and launch-configuration handling. Host
    tables are range-checked by the public API (device ones would not be), and addresses of
    simulator arrays cost more than `data_ptr()`: an upper bound of the GPU's Python cost."""
    use_stubbed_simulator()
    import torch

    import kernels
    from kernels.cuda import graph, plan

    gen = torch.Generator().manual_seed(0)
    batch, ctx, block = 64, 512, 16
    kc = torch.randn((batch * ctx // block, NUM_KV_HEADS, block, HEAD_DIM), generator=gen).half()
    vc = torch.randn_like(kc)
    tables = torch.randperm(kc.shape[0], generator=gen).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), generator=gen).half()
    out = torch.empty_like(q)
    the_plan = plan.DecodePlan(kc, NUM_HEADS, batch, tables.shape[1], num_parts=1)
    graphs = graph.DecodeGraphs([kc], [vc], NUM_HEADS, tables.shape[1], 0.1, buckets=(batch,))
    graphs.prepare(tables, lens)
    graphs._graph(0, batch)._launch = lambda: None  # the replay itself
    paths = {
        "public API (validation + dispatch)": lambda: kernels.paged_attention_decode(
            q, kc, vc, tables, lens, 0.1, out=out, backend="cuda"),
        "DecodePlan.launch": lambda: the_plan.launch(q, kc, vc, tables, lens, 0.1, out),
        # q already in the bucket's buffer: a host-side copy of 512 KB would dominate here,
        # while on a GPU it is one asynchronous launch
        "DecodeGraphs.run (replay)": lambda: graphs.run(0, graphs.query_buffer()),
    }
    costs = {}
    for name, fn in paths.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        costs[name] = (time.perf_counter() - t0) / calls * 1e6
        print(f"{name}: {costs[name]:.1f} us per call (launch stubbed)", flush=True)
    return costs


# ------------------------------------------------------------------------------------------
# Phases 0, 1, 8 (the others live in gpu_check_{correct,decode,prefill,engine}.py)
# ------------------------------------------------------------------------------------------


def jit_variants(smoke: bool) -> list[tuple[str, str, int, int]]:
    """(mode, kind, head_dim, block_size) of every variant the timing phases launch."""
    out = []
    for kind, head_dim in (("f16", 128), ("bf16", 128), ("f16", 64), ("bf16", 64)):
        out += [("decode", kind, head_dim, 16), ("split", kind, head_dim, 16),
                ("prefill", kind, head_dim, 16)]
    for block in (8, 32, 64):
        out += [("decode", "f16", 128, block), ("split", "f16", 128, block)]
    return out[:4] if smoke else out


def kernel_facts(dispatcher: Any, signature: Any, threads: int) -> dict[str, Any]:
    """Registers, local memory (spills), shared memory and resident blocks per SM of one
    compiled kernel, as built on this GPU (sm_90a on an H100/H200; the static gate builds
    sm_90, review §5.6). Empty under the simulator."""
    overload = getattr(dispatcher, "overloads", {}).get(signature)
    if overload is None:
        return {}
    from kernels.cuda._runtime import num_sms

    facts: dict[str, Any] = {}
    for key, attr in (("regs", "regs_per_thread"), ("local_bytes", "local_mem_per_thread"),
                      ("shared_bytes", "shared_mem_per_block")):
        value = getattr(overload, attr, None)
        facts[key] = value() if callable(value) else value
    grid = overload.max_cooperative_grid_blocks(threads)
    facts["resident_blocks"] = int(grid)
    facts["blocks_per_sm"] = int(grid) / num_sms()
    return facts


def phase_jit(ctx: PhaseContext, smoke: bool) -> None:
    from kernels.cuda import decode, decode_split, prefill
    from kernels.cuda._host import spec_for

    build = {"decode": (decode.decode_kernel, decode.DECODE_SIGNATURE),
             "split": (decode_split.split_kernel, decode_split.SPLIT_SIGNATURE),
             "prefill": (prefill.prefill_kernel, prefill.PREFILL_SIGNATURE)}
    for mode, kind, head_dim, block in jit_variants(smoke):
        def cell(mode: str = mode, kind: str = kind, head_dim: int = head_dim,
                 block: int = block) -> dict[str, Any]:
            spec = spec_for(head_dim, block, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, kind, kind,
                            kind, mode)
            factory, signature = build[mode]
            t0 = time.perf_counter()
            dispatcher = factory(spec)
            seconds = time.perf_counter() - t0
            row = {"mode": mode, "kind": kind, "head_dim": head_dim, "block_size": block,
                   "jit_s": seconds, "threads": spec.num_threads,
                   **kernel_facts(dispatcher, signature, spec.num_threads)}
            if mode == "decode":  # what the split policy is told (one number or per kernel)
                row["policy_resident"] = str(decode.resident_blocks(spec))
            return row

        ctx.cell(f"{mode} {kind} d{head_dim} bs{block}", cell)


def phase_host(ctx: PhaseContext, torch: Any, timer: Any, device: str, max_reps: int) -> None:
    """Python µs per call of each launch path (B=64 x 512 decode, a 512-token prefill chunk
    after 3.5k tokens, a 64-token write; the last two also through a step's plans), beside the
    kernel-only time of the same call."""
    from gpu_check_correct import paged_inputs
    from gpu_timing import time_call

    import kernels
    from kernels.cuda.graph import DecodeGraphs
    from kernels.cuda.plan import DecodePlan
    from kernels.cuda.prefill_plan import PrefillPlan, SlotWritePlan

    gen = torch.Generator(device=device).manual_seed(1)
    inp = paged_inputs(torch, gen, [512] * 64, 16, torch.float16)
    q = torch.randn((64, NUM_HEADS, HEAD_DIM), device=device, dtype=torch.float16)
    out = torch.empty_like(q)
    width = int(inp["block_tables"].shape[1])
    plan = DecodePlan(inp["key_cache"], NUM_HEADS, 64, width)
    graphs = DecodeGraphs([inp["key_cache"]], [inp["value_cache"]], NUM_HEADS, width, 0.1,
                          buckets=(64,))
    graphs.prepare(inp["block_tables"], inp["seq_lens"])
    graphs.capture()
    pin = paged_inputs(torch, gen, [4096], 16, torch.float16)
    qp = torch.randn((512, NUM_HEADS, HEAD_DIM), device=device, dtype=torch.float16)
    outp = torch.empty_like(qp)
    starts = torch.tensor([0, 512], dtype=torch.int32, device=device)
    kv = torch.randn((64, NUM_KV_HEADS, HEAD_DIM), device=device, dtype=torch.float16)
    slots = torch.arange(64, dtype=torch.int64, device=device) * 16
    paths: dict[str, Callable[[int], Any]] = {
        "public decode API (validation + dispatch)": lambda _: kernels.paged_attention_decode(
            q, scale=0.1, out=out, backend="cuda", **inp),
        "DecodePlan.launch": lambda _: plan.launch(q, inp["key_cache"], inp["value_cache"],
                                                   inp["block_tables"], inp["seq_lens"], 0.1, out),
        "DecodeGraphs.run (copy q + replay)": lambda _: graphs.run(0, q),
        "public prefill API (512 after 3584)": lambda _: kernels.paged_prefill_attention(
            qp, query_start_loc=starts, scale=0.1, out=outp, backend="cuda", max_query_len=512,
            **pin),
        "public write_slots (64 tokens)": lambda _: kernels.write_slots(
            kv, kv, inp["key_cache"], inp["value_cache"], slots, backend="cuda"),
        # the same two calls through a step's plans, bound at their first call (issue 43 item 3)
        "PrefillPlan.attend (512 after 3584)": lambda _: prefill_plan.attend(
            qp, pin["key_cache"], pin["value_cache"], outp),
        "SlotWritePlan.write (64 tokens)": lambda _: write_plan.write(
            kv, kv, inp["key_cache"], inp["value_cache"]),
    }
    prefill_plan = PrefillPlan(pin["block_tables"], pin["seq_lens"], starts, 0.1, max_query_len=512)
    write_plan = SlotWritePlan(slots)
    reps = min(20, max_reps)

    def cell(name: str, fn: Callable[[int], Any]) -> dict[str, Any]:
        return {"path": name, **time_call(timer, fn, reps=reps, b2b_calls=10 * reps).as_row()}

    for name, fn in paths.items():
        ctx.cell(name, functools.partial(cell, name, fn))


# ------------------------------------------------------------------------------------------
# Report and main
# ------------------------------------------------------------------------------------------


def render(result: PhaseResult) -> list[str]:
    lines = [f"## {result.name} — {result.status} ({result.seconds:.1f} s)", ""]
    if result.message:
        lines += [result.message, ""]
    failed = result.failures + result.errors
    if failed:
        lines += ["Failed:", ""] + [f"- {f}" for f in failed] + [""]
    return lines + rows_table(result.rows) + [""]


def device_header(torch: Any, device: str) -> dict[str, Any]:
    header: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import numba
        import numpy

        header.update(numba=numba.__version__, numpy=numpy.__version__)
    except ImportError:
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        header.update(device=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                      memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}")
    else:
        header["device"] = "CPU smoke run (Numba simulator, launches stubbed)"
    return header


def build_phases(args: argparse.Namespace, torch: Any, device: str, state: dict[str, Any]) -> list[PhaseSpec]:
    """The phase table of the module doc, bound to this run."""
    import gpu_check_correct
    from gpu_check_decode import DecodeBench, phase_ab, phase_grid, phase_million
    from gpu_check_engine import SMOKE_ENGINE, EngineSizes, engine_cells
    from gpu_check_prefill import PrefillBench, phase_prefill
    from gpu_check_prefill_ab import AB_DIR, phase_prefill_ab
    from gpu_check_step_graph import phase_step_graph
    from gpu_model import LLAMA_1B, LLAMA_8B_LAYERS, SMOKE_MODEL
    from gpu_sizes import FULL, SMOKE
    from gpu_timing import Timer, copy_gbs

    smoke = args.cpu_smoke
    sizes = SMOKE if smoke else FULL
    if args.max_reps:
        from dataclasses import replace

        sizes = replace(sizes, max_reps=args.max_reps)
    timer = Timer(torch, device)
    gpu_check_correct.DEVICE = device

    def setup(ctx: PhaseContext) -> None:
        def measure() -> dict[str, Any]:
            gbs = copy_gbs(torch, timer, device, nbytes=(64 << 20) if smoke else (4 << 30))
            state["copy_gbs"] = gbs
            return {"copy_gbs": gbs, "spin": timer.can_spin(),
                    "spin_cycles_per_us": timer.cycles_per_us() if timer.can_spin() else None}

        ctx.cell("copy bandwidth", measure)

    def decode_bench() -> DecodeBench:
        return DecodeBench(torch, timer, device, sizes, state.get("copy_gbs") or 4000.0)

    engine_sizes = SMOKE_ENGINE if smoke else EngineSizes()
    engine_8b_sizes = SMOKE_ENGINE if smoke else EngineSizes(num_requests=64)

    def engine(shape: Any, esizes: EngineSizes) -> Any:
        return lambda ctx: engine_cells(ctx, SMOKE_MODEL if smoke else shape, device,
                                        state.get("copy_gbs") or 4000.0, esizes)

    return [
        PhaseSpec("setup", 15, setup, about="device copy bandwidth"),
        PhaseSpec("jit", 75, lambda ctx: phase_jit(ctx, smoke), min_s=20,
                  about="compile time and machine facts per variant"),
        PhaseSpec("correctness", 80, lambda ctx: gpu_check_correct.phase_correctness(ctx, torch, smoke),
                  min_s=30, gate=not smoke, about="float64 matrix, determinism, node graphs"),
        PhaseSpec("decode", 35, lambda ctx: phase_grid(ctx, decode_bench()), min_s=10,
                  about="B x context grid: direct, graph, SDPA"),
        PhaseSpec("decode_ab", 35, lambda ctx: phase_ab(ctx, decode_bench()), min_s=10,
                  about="split counts, paging, block size, bf16/d64, ragged"),
        PhaseSpec("million", 20, lambda ctx: phase_million(ctx, decode_bench()), min_s=10,
                  gate=not smoke, about="1M-token decode and prefill chunk vs float64"),
        PhaseSpec("prefill", 30, lambda ctx: phase_prefill(ctx, PrefillBench(torch, timer, device, sizes)),
                  min_s=10, about="8k prompt dtypes/head dims, chunks after cached prefixes"),
        PhaseSpec("engine_1b", 100, engine(LLAMA_1B, engine_sizes), min_s=0 if smoke else 60,
                  about="bf16 Llama-3.2-1B shape vs transformers and the floor"),
        PhaseSpec("host", 10, lambda ctx: phase_host(ctx, torch, timer, device, sizes.max_reps), min_s=4,
                  about="Python µs per launch path"),
        PhaseSpec("step_graph", 25, lambda ctx: phase_step_graph(ctx, device, smoke), min_s=12,
                  about="whole-step decode graphs vs eager, teacher-forced"),
        PhaseSpec("prefill_ab", 45, lambda ctx: phase_prefill_ab(
            ctx, sizes.prefill_tokens, smoke, args.prefill_ab or AB_DIR), min_s=15,
            about="8k prefill per prepared kernel version"),
        PhaseSpec("engine_8b", 70, engine(LLAMA_8B_LAYERS, engine_8b_sizes),
                  min_s=0 if smoke else 50, about="4 Llama-3-8B layers (d128) vs transformers"),
    ]


def select(phases: list[PhaseSpec], only: str, skip: str) -> list[PhaseSpec]:
    """Phases named in `only` (all when empty) minus those in `skip`, in the table's order;
    an unknown name is an error (a typo must not silently run nothing)."""
    names = {p.name for p in phases}
    wanted = {n for n in only.split(",") if n}
    dropped = {n for n in skip.split(",") if n}
    unknown = (wanted | dropped) - names
    if unknown:
        raise SystemExit(f"gpu_check: unknown phase(s) {sorted(unknown)}; phases: "
                         f"{[p.name for p in phases]}")
    return [p for p in phases if (not wanted or p.name in wanted) and p.name not in dropped]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.host_path_cpu:
        host_path_cpu()
        return 0
    if args.cpu_smoke:
        use_stubbed_simulator()
    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    if not args.cpu_smoke:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False); "
                  "nothing was checked", file=sys.stderr)
            return EXIT_NO_GPU
        from numba import cuda

        if not cuda.is_available():
            print("gpu_check: no CUDA GPU visible to Numba (numba.cuda.is_available() is False); "
                  "nothing was checked", file=sys.stderr)
            return EXIT_NO_GPU
    started = time.time()
    header = device_header(torch, device)
    header["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
    header["deadline_s"] = args.deadline_s
    results_log = ResultsLog(args.out)
    results_log.write({"event": "run", **header, "argv": sys.argv[1:] if argv is None else argv})
    log(f"{header['device']}, torch {torch.__version__}, results → {args.out}")
    state: dict[str, Any] = {}

    def summary(results: list[PhaseResult]) -> None:
        targets = judge({r.name: r.rows for r in results})
        write_summary(args.out, {**header, "wall_s": round(time.time() - started, 1)}, results,
                      render, preface=target_lines(targets), extra={"targets": targets})
        last = results[-1]
        log(f"phase {last.name}: {last.status} in {last.seconds:.1f} s, {len(last.rows)} rows, "
            f"{len(last.failures)} failed checks, {len(last.errors)} errors {last.message}")

    runner = Runner(results_log, args.deadline_s, on_phase_end=summary)

    def on_term(signum: int, frame: Any) -> None:  # the wrapper's timeout: say where it was
        results_log.write({"event": "killed", "signal": signum,
                           "phases_done": [r.name for r in runner.results]})
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, on_term)
    for spec in select(build_phases(args, torch, device, state), args.phases, args.skip):
        log(f"phase {spec.name} (budget {spec.budget_s:.0f} s, {runner.time_left():.0f} s left)")
        runner.run(spec)
    failed = runner.gate_failures()
    errors = runner.errors()
    results_log.write({"event": "done", "wall_s": round(time.time() - started, 1),
                       "gate_failures": failed, "errors": len(errors)})
    results_log.close()
    log(f"done in {time.time() - started:.0f} s; {len(failed)} correctness failure(s), "
        f"{len(errors)} cell error(s)")
    if args.cpu_smoke:
        for e in errors:
            log(f"smoke error: {e}")
        return 1 if errors else 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
