"""Where a decode step's time goes outside the matmuls: `ModelRunner.execute` on the SmolLM-135M
shape (bench_vs_vllm.py's random-weight model), per step at 1 and at 24 decode rows, split into
the model's parts by timing wrappers around each of them.

Each part (the dense matmuls, attention, the fused norms, RoPE, SiLU·mul, the LM head, the
sampler, the runner's step preparation) is wrapped for the timed steps only; "other" is the step
minus every wrapped part: the Python of the layer loop, the embedding, views and the runner.
Also counted, deterministically: calls per step of each part (a panel GEMM call is one Numba
parallel-region launch). The host is shared: medians over `--steps`, numbers indicative.

    .venv/bin/python bench/bench_decode_parts.py [--rows 1,24] [--steps 40] [--context 128] \
        [--modes op,fused] [--repeats 3] [--threads 1 --clock thread]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compute_node.model import ModelRunner, SamplingParams, SeqWork  # noqa: E402
from compute_node.model import model as model_mod  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


class Parts:
    """Seconds and calls per part over the steps being timed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        self.clock: Callable[[], float] = time.perf_counter

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            started = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += self.clock() - started
                self.calls[name] += 1
        return timed


@contextmanager
def patched(obj: Any, name: str, parts: Parts, label: str) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, parts.wrap(label, original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def model_dir() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_vs_vllm import build_model

    return build_model("smollm-135m", Path(tempfile.gettempdir()) / "pagedkv-bench-models")


def measure(runner: ModelRunner, rows: int, context: int, steps: int, clock: Callable[[], float]) -> None:
    bs = runner.geometry.block_size
    per_seq = -(-(context + steps + 8) // bs)
    seqs: list[list[Any]] = []   # [seq id, last token, computed tokens, block table]
    for i in range(rows):
        prompt = [5 + (i * 131 + j) % 40000 for j in range(context)]
        table = list(range(i * per_seq, (i + 1) * per_seq))
        out = runner.execute([SeqWork(f"s{i}", prompt, 0, table, GREEDY)])[0]
        seqs.append([f"s{i}", out.token_id if out else 0, context, table])
    parts = Parts()
    parts.clock = clock
    model = runner.model
    targets = [
        (model_mod.dense, "linear", "matmuls (incl. LM head)"),
        (model_mod, "paged_attention", "attention"),
        (model_mod, "cpu_rms_norm", "add+rms_norm"),
        (model_mod, "rope_qkv", "rope_qkv"),
        (model, "_silu_mul", "silu_mul"),
        (model_mod.FusedLayers, "attention_input", "fused: norm+qkv+rope"),
        (model_mod.FusedLayers, "attention_output_mlp", "fused: o+norm+mlp"),
        (model, "final_hidden", "final norm"),
        (runner.sampler, "sample", "sampler"),
        (runner, "_prepare", "prepare"),
    ]
    step_times = []
    with_patches: list[Any] = [patched(o, n, parts, label) for o, n, label in targets]
    for p in with_patches:
        p.__enter__()
    try:
        for k in range(steps):
            batch = [SeqWork(s[0], [s[1]], s[2], s[3], GREEDY, k + 1) for s in seqs]
            parts.on = k >= 3
            started = clock()
            outs = runner.execute(batch)
            if parts.on:
                step_times.append(clock() - started)
            for s, out in zip(seqs, outs):
                s[1], s[2] = (out.token_id if out else 0), s[2] + 1
    finally:
        for p in reversed(with_patches):
            p.__exit__(None, None, None)
    n = len(step_times)
    step_ms = statistics.median(step_times) * 1e3
    mean_ms = statistics.fmean(step_times) * 1e3
    mode = "fused layers" if model._fused_layer_weights() is not None else "op by op"
    print(f"\n## {mode}, {rows} row(s), context {context}: step median {step_ms:.2f} ms, mean {mean_ms:.2f} ms "
          f"({rows / step_ms * 1e3:.1f} tok/s at the median)")
    print(f"{'part':28s} {'ms/step':>8s} {'calls/step':>10s}")
    for label, secs in sorted(parts.seconds.items(), key=lambda kv: -kv[1]):
        print(f"{label:28s} {secs / n * 1e3:8.2f} {parts.calls[label] / n:10.1f}")
    other = sum(step_times) - sum(parts.seconds.values())
    print(f"{'other (loop, embed, views)':28s} {other / n * 1e3:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,24")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--modes", default="op,fused", help="op (op by op) and/or fused (DecoderModel.fused_layers)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every mode, alternated")
    ap.add_argument("--threads", type=int, default=None, help="Numba and torch threads (default: all)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: this thread's CPU time (with --threads 1: less noise on a busy host)")
    args = ap.parse_args()
    if args.threads is not None:
        import numba
        import torch

        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    runner = ModelRunner(model_dir(), block_size=16, num_blocks=2048, dtype="float32", device="cpu")
    for rows in (int(r) for r in args.rows.split(",")):
        for _ in range(args.repeats):
            for mode in args.modes.split(","):
                runner.model.fused_layers = mode == "fused"
                measure(runner, rows, args.context, args.steps, clock)


if __name__ == "__main__":
    main()
