"""Async scheduling benchmark (issue 21, item 2): the step period with and without overlap.

1. A node that takes a fixed time per step (`--node-ms`, 20 by default: it sleeps, as a GPU
   running the step would leave the engine's CPU free) and `--seqs` running sequences (256)
   over the embedded block manager: the step period in steady decode vs the node's time, and
   generated tokens/s, overlapped (`async_scheduling=True`) vs not, alternating in one run.
   Without overlap the period is node + engine (plan, Step, output processing); with it the
   plan, the Step, the acceptance of the tokens and the outputs run while the node sleeps, and
   the node waits between two calls (printed: "node idle") only for the hand-over of the
   answers. The collector is set as `pagedkv-serve` sets it (`--gc default`: Python's
   defaults, whose full collections pause the engine ~65 ms now and then). Prompt lengths
   are staggered over a block (1/block_size of the sequences start or fill a block each step,
   as in a running batch); `--aligned` gives them all one length, so they all cross a block in
   the same step.
2. The real model on CPU (`LLM`, embedded, the demo's ~54M random-weight Llama, float32):
   requested tokens/s on `bench_model`'s workload, overlapped vs not, alternating.

    .venv/bin/python bench/bench_overlap.py [--seqs 256] [--node-ms 20] [--steps 120] [--aligned] [--requests 32]
                                            [--gc tuned|default]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from block_manager.service.config import BlockManagerConfig  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.local_bm import LocalBlockManagerClient  # noqa: E402
from engine.node_api import NodeInfo, NodeStep, SampledToken  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

VOCAB = 32000


class FixedTimeNode:
    """A node whose every step takes `step_s` (slept: the engine's thread is free meanwhile)."""

    def __init__(self, client: LocalBlockManagerClient, node_id: str, num_blocks: int, block_size: int,
                 step_s: float) -> None:
        self.node_id, self.num_blocks, self.block_size, self.step_s = node_id, num_blocks, block_size, step_s
        client.register_node(node_id, num_blocks, block_size=block_size, geometry={
            "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32", "device": "cpu"})
        self.busy_s = 0.0
        self.calls = 0
        self.idle_s = 0.0                 # between the end of one call and the start of the next
        self.last_end: float | None = None

    def info(self, timeout_s: float | None = None) -> NodeInfo:
        return NodeInfo(self.node_id, 1, True, self.block_size, self.num_blocks, "fixed", VOCAB, 1 << 20, ())

    def generate(self, step: NodeStep) -> list[SampledToken]:
        t0 = time.perf_counter()
        if self.last_end is not None:
            self.idle_s += t0 - self.last_end
        time.sleep(self.step_s)
        out = [SampledToken(s.seq_id, 1 + (s.token_ids[-1] * 31 + s.context_len) % (VOCAB - 1))
               for s in step.sequences if s.sampling is not None]
        self.last_end = time.perf_counter()
        self.busy_s += self.last_end - t0
        self.calls += 1
        return out

    def close(self) -> None:
        pass


def fixed_node_run(async_scheduling: bool, seqs: int, node_ms: float, steps: int, block_size: int,
                   aligned: bool = False) -> dict[str, float]:
    """Steady decode of `seqs` sequences: the period of `steps` steps after all are running."""
    client = LocalBlockManagerClient(BlockManagerConfig(database_url="memory://", block_size=block_size))
    max_tokens = steps + 64
    num_blocks = seqs * -(-(32 + block_size + max_tokens + 2) // block_size) + 64
    node = FixedTimeNode(client, "fixed-0", num_blocks, block_size, node_ms / 1e3)
    engine = LLMEngine(client, {"fixed-0": node}, EngineConfig(
        max_num_seqs=seqs, max_num_batched_tokens=max(8192, 32 * seqs), async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(seqs):
        length = 32 if aligned else 32 + i % block_size
        engine.add_request([1 + (i * 7 + j) % (VOCAB - 1) for j in range(length)], params)
    for _ in range(4):   # admission, prefill, the pipeline filled
        engine.step()
    generated0, bm0, node0, calls0 = engine.stats.generated_tokens, engine.stats.bm_s, node.busy_s, node.calls
    idle0 = node.idle_s
    serial0 = (engine.stats.prepare_s, engine.stats.complete_s, engine.stats.outputs_s)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    st = engine.stats
    periods = list(st.step_s)[-steps:]
    out = {
        "period_ms": 1e3 * wall / steps, "median_ms": 1e3 * statistics.median(periods),
        "node_ms": 1e3 * (node.busy_s - node0) / max(1, node.calls - calls0),   # per call
        "idle_ms": 1e3 * (node.idle_s - idle0) / max(1, node.calls - calls0),   # the node waiting, per call
        "bm_ms": 1e3 * (st.bm_s - bm0) / steps,
        "tok_s": (st.generated_tokens - generated0) / wall,
        "tokens_per_step": (st.generated_tokens - generated0) / steps,
        "speculative": st.speculative_tokens, "waits": st.speculation_waits, "late": st.late_tokens,
        **{f"{name}_ms": 1e3 * (now - before) / steps for name, now, before in
           zip(("prepare", "complete", "outputs"), (st.prepare_s, st.complete_s, st.outputs_s), serial0)},
    }
    engine.close()
    return out


def model_run(llm: object, workload: list[tuple[list[int], int]], async_scheduling: bool) -> float:
    engine = llm.engine   # type: ignore[attr-defined]
    engine.config.async_scheduling = async_scheduling
    for p, n in workload:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0
    engine.flush()
    return sum(n for _, n in workload) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--node-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--aligned", action="store_true", help="every prompt one length (all cross blocks together)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32, help="real-model part (0: skip it)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps-only", action="store_true", help="only the fixed-time node part")
    ap.add_argument("--model-only", action="store_true", help="only the real-model part")
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--gc", choices=("tuned", "default"), default="tuned",
                    help="tuned: the collector as pagedkv-serve sets it once started (pagedkv.lifecycle.tune_gc)")
    args = ap.parse_args()
    if args.gc == "tuned":
        from pagedkv.lifecycle import tune_gc

        tune_gc()
    if args.model_only:
        return model_part(args)
    print(f"# bench_overlap  fixed-time node {args.node_ms:g} ms/step, {args.seqs} running sequences, "
          f"block size {args.block_size}, {'aligned' if args.aligned else 'staggered'} prompts, {args.steps} steady "
          f"decode steps, alternating x{args.repeats}, {args.gc} gc")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for mode in (False, True):
            runs[mode].append(fixed_node_run(mode, args.seqs, args.node_ms, args.steps, args.block_size,
                                             args.aligned))
    best = {mode: min(rs, key=lambda r: r["period_ms"]) for mode, rs in runs.items()}
    for mode in (False, True):
        r = best[mode]
        name = "overlapped" if mode else "sequential"
        print(f"{name}  period {r['period_ms']:6.2f} ms (median {r['median_ms']:6.2f}) = "
              f"{r['period_ms'] / r['node_ms']:.3f}x the node's measured time ({r['node_ms']:.2f} ms a call: the "
              f"sleep overshoots on a loaded host; {r['period_ms'] / args.node_ms:.3f}x of {args.node_ms:g} ms), block "
              f"manager Step {r['bm_ms']:.2f} ms, node idle {r['idle_ms']:.2f} ms between calls | "
              f"{r['tok_s']:8.0f} tok/s, {r['tokens_per_step']:.1f} tokens/step | "
              f"speculative {int(r['speculative'])} (late ids {int(r['late'])}), sat out {int(r['waits'])} | "
              f"engine thread: prepare {r['prepare_ms']:.2f}, complete {r['complete_ms']:.2f}, "
              f"outputs {r['outputs_ms']:.2f} ms a step")
    print(f"overlapped / sequential: period {best[True]['period_ms'] / best[False]['period_ms']:.3f}x, "
          f"tokens/s {best[True]['tok_s'] / best[False]['tok_s']:.3f}x")
    if args.requests > 0 and not args.steps_only:
        model_part(args)


def model_part(args: argparse.Namespace) -> None:
    import torch
    from bench_model import make_workload

    from compute_node.model.tiny import build_tiny_model, count_parameters
    from engine.llm import LLM

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", "llama", seed=0)
        workload = make_workload(args.requests, 8192, 0)
        max_len = max(len(p) + n for p, n in workload)
        num_blocks = args.requests * -(-max_len // args.block_size) + 64
        llm = LLM(model_dir, block_size=args.block_size, num_kv_blocks=num_blocks, device="cpu",
                  max_num_batched_tokens=args.budget, max_num_seqs=args.requests)
        model_run(llm, make_workload(2, 8192, 99), True)
        tput: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for mode in (False, True):
                tput[mode].append(model_run(llm, workload, mode))
        llm.close()
        on, off = max(tput[True]), max(tput[False])
        print(f"# real model llama {count_parameters(model_dir) / 1e6:.1f}M fp32 cpu, torch threads "
              f"{torch.get_num_threads()}, {args.requests} requests, {sum(n for _, n in workload)} requested tokens, "
              f"best of {args.repeats}")
        print(f"sequential {off:7.1f} tok/s | overlapped {on:7.1f} tok/s | ratio {on / off:.3f}x "
              f"(all runs: sequential {[round(x) for x in tput[False]]}, overlapped {[round(x) for x in tput[True]]})")


if __name__ == "__main__":
    main()
