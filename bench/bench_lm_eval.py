"""lm-eval (EleutherAI's harness, `--model local-completions`) against `pagedkv-serve` and, when
given, vLLM's OpenAI server: does it run to completion, how long it takes, and whether both
servers score the same model the same (issue 44).

The tasks are local (bench/lm_eval_task: a multiple-choice task and a perplexity task, JSONL +
task YAML, no Hub download); lm-eval scores them through `/v1/completions` with `echo=true`,
`logprobs` and token-id prompts — the prompt log-probabilities. Both servers serve the same
random-weight model (SmolLM-135M's shape, float32, from bench_vs_vllm.py), so the scores are
meaningless as quality but must agree between the servers (same model, same float32 maths up
to summation order).

Peers in their own venvs:

    python3 -m venv L && L/bin/pip install "lm-eval[api]"
    .venv/bin/python bench/bench_lm_eval.py --lm-eval L/bin/lm_eval [--vllm-python V/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve_vs_vllm import free_port, peer_env, running, server_commands  # noqa: E402
from bench_vs_vllm import build_model  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASKS = "pagedkv_mc_facts,pagedkv_rolling_text"


def lm_eval_command(lm_eval: str, port: int, name: str, model: Path, out: Path, concurrency: int) -> list[str]:
    model_args = (f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={model},num_concurrent={concurrency},max_retries=1,tokenized_requests=True")
    return [lm_eval, "--model", "local-completions", "--model_args", model_args, "--tasks", TASKS,
            "--include_path", str(TASK_DIR), "--output_path", str(out), "--batch_size", "1"]


def scores(out_dir: Path) -> dict[str, dict[str, float]]:
    """Task -> metric -> value from lm-eval's results JSON (the newest under `out_dir`)."""
    files = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"lm-eval wrote no results under {out_dir}")
    results = json.loads(files[-1].read_text())["results"]
    return {task: {k.split(",")[0]: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len"}
            for task, metrics in results.items()}


def run(side: str, args: argparse.Namespace, model: Path, tmp: Path) -> tuple[float, dict]:
    port = free_port()
    cmds = server_commands(side, model, "smollm-135m", port, args.vllm_python, "smollm-135m")
    with running(side, cmds, port, tmp, "all"):
        out = tmp / f"lm-eval-{side}"
        cmd = lm_eval_command(args.lm_eval, port, "smollm-135m", model, out, args.concurrency)
        started = time.perf_counter()
        log = tmp / f"lm-eval-{side}.log"
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=TASK_DIR, env=peer_env()).returncode
        wall = time.perf_counter() - started
        if rc != 0:
            raise RuntimeError(f"lm-eval failed against {side} (rc {rc}):\n"
                               + "\n".join(log.read_text().splitlines()[-25:]))
        return wall, scores(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", required=True, help="lm-eval's executable (lm_eval, in its own venv)")
    p.add_argument("--vllm-python", default="", help="vLLM's venv python: also run against its server (compiled)")
    p.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent")
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "pagedkv-bench-models"))
    args = p.parse_args(argv)
    model = build_model("smollm-135m", Path(args.models))
    sides = ["ours"] + (["compiled"] if args.vllm_python else [])
    print(f"# lm-eval local-completions, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"tasks {TASKS}, num_concurrent {args.concurrency}")
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            wall, found[side] = run(side, args, model, Path(tmp))
            print(f"{side}: {wall:.1f} s  {json.dumps(found[side], sort_keys=True)}", flush=True)
    if len(found) == 2:
        for task, metrics in found["ours"].items():
            for metric, ours in metrics.items():
                theirs = found["compiled"].get(task, {}).get(metric)
                rel = abs(ours - theirs) / max(abs(theirs), 1e-12) if theirs is not None else None
                print(f"{task} {metric}: pagedkv {ours:.6g} vLLM {theirs} relative difference {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
