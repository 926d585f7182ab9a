"""Engine benchmark (issue 12): `pagedkv.LLM` (the whole engine, embedded: block manager state
machine, step protocol, model node) vs transformers `generate`, CPU, float32, the demo's
~54M-parameter random-weight Llama (built in a temp dir).

Same workload and transformers side as `bench_model.py` (which times the model runner alone):
`--requests` requests, prompts uniform in [16, 512], outputs uniform in [16, 128], greedy, EOS
ignored; transformers does one left-padded `generate` over all of them. Ours and theirs
alternate `--repeats` times in one process and each side's fastest run is kept (ratios; the
machine is shared).

1. Throughput (requested tokens/s) and peak KV memory (ours: peak blocks in use, from the block
   manager, x bytes per block; theirs: the dynamic cache's tensors at the end).
2. Batch-1 decode latency: our median inter-token latency for one request vs transformers'
   per-token time.
3. Where a decode step goes at batch 32: model (dense layers + sampling), attention kernels,
   block manager (the Step: state machine + client), and the rest (engine bookkeeping, building
   and parsing the Generate messages); engine overhead = everything but model and kernels.

    .venv/bin/python bench/bench_engine.py [--requests 32] [--budget 2048] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_model import (  # noqa: E402
    cpu_seconds,
    decode_latency_transformers,
    make_workload,
    run_ours,
    run_transformers,
)

from compute_node.model.tiny import build_tiny_model, count_parameters  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.params import SamplingParams  # noqa: E402


def run_engine(llm: LLM, workload: list[tuple[list[int], int]]) -> dict[str, object]:
    engine = llm.engine
    pool = next(iter(engine.pool_blocks))
    core = llm.client.state.core   # the embedded block manager (LocalBlockManagerClient)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in workload]
    outs: dict[str, list[int]] = {}
    peak = 0
    started, cpu0 = time.perf_counter(), cpu_seconds()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        peak = max(peak, core.metrics(pool).num_used_blocks)
    seconds, cpu_s = time.perf_counter() - started, cpu_seconds() - cpu0
    engine.flush()
    return {"seconds": seconds, "cpu_s": cpu_s, "outputs": [outs[i] for i in ids], "peak_blocks": peak}


def decode_split(llm: LLM, batch: int, steps: int, prompt_len: int = 64) -> dict[str, float]:
    """Decode steps at `batch` running sequences of `prompt_len`-token prompts, split by phase
    (seconds per step)."""
    engine = llm.engine
    node = next(iter(engine.nodes.values()))
    runner = node.runner   # type: ignore[attr-defined]
    # Turned on while no step is in flight: with async scheduling a step running on the node
    # puts back the flag it found when it ends, which would undo a flip made meanwhile.
    runner.profile = True
    # the warm-up: admissions and every prompt's prefill, then steady decode; outputs long
    # enough that no sequence finishes (and the batch shrinks) inside the timed steps
    warm = 4 + -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    for i in range(batch):
        engine.add_request([5 + (i * 7 + j) % 4000 for j in range(prompt_len)],
                           SamplingParams(temperature=0, max_tokens=warm + steps + 8, ignore_eos=True))
    for _ in range(warm):
        engine.step()
    acc = {"step": 0.0, "bm": 0.0, "node": 0.0}
    phases = {"dense": 0.0, "attention": 0.0, "sample": 0.0, "prepare": 0.0}
    num_timed = 0
    try:
        for _ in range(steps):
            bm0, node0 = engine.stats.bm_s, engine.stats.node_s
            runner.last_timings = None
            t0 = time.perf_counter()
            engine.step()
            acc["step"] += time.perf_counter() - t0
            acc["bm"] += engine.stats.bm_s - bm0
            acc["node"] += engine.stats.node_s - node0
            # With async scheduling (on by default on a GPU) step() can return before the node
            # ran its step: that step's phases arrive with a later one, or not in this window.
            t = runner.last_timings
            if t is not None:
                num_timed += 1
                for key in phases:
                    phases[key] += getattr(t, f"{key}_s")
    finally:
        while engine.has_unfinished_requests():
            engine.step()
        engine.flush()
        runner.profile = False
    split = {k: v / steps for k, v in acc.items()}
    split.update({k: v / max(num_timed, 1) for k, v in phases.items()})
    return split


def batch1_itl(llm: LLM, context: int, steps: int) -> float:
    engine = llm.engine
    rid = engine.add_request([5 + i % 1000 for i in range(context)],
                             SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    times = []
    while rid in engine.requests:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.flush()
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--b1-context", type=int, default=256)
    ap.add_argument("--b1-steps", type=int, default=32)
    ap.add_argument("--split-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both sides run there)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", "llama", seed=args.seed)
        workload = make_workload(args.requests, 8192, args.seed)
        max_len = max(len(p) + n for p, n in workload)
        num_blocks = args.requests * -(-max_len // args.block_size) + 64
        llm = LLM(model_dir, block_size=args.block_size, num_kv_blocks=num_blocks, device=args.device,
                  max_num_batched_tokens=args.budget, max_num_seqs=max(args.requests, args.split_batch))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(args.device)
        runner = llm.engine.nodes["local-0"].runner   # type: ignore[attr-defined]
        run_engine(llm, make_workload(2, 8192, 99))
        run_transformers(hf, make_workload(2, 8192, 99), 1)
        ours, theirs, bare, b1_ours, b1_theirs = [], [], [], [], []
        for _ in range(args.repeats):
            ours.append(run_engine(llm, workload))
            theirs.append(run_transformers(hf, workload, 1))
            # the model runner under bench_model's minimal loop, on the same pool (the engine is idle)
            bare.append(run_ours(runner, workload, args.budget))
            b1_ours.append(batch1_itl(llm, args.b1_context, args.b1_steps))
            b1_theirs.append(decode_latency_transformers(hf, args.b1_context, args.b1_steps))
        o = min(ours, key=lambda r: r["seconds"])
        t = min(theirs, key=lambda r: r.seconds)
        requested = sum(n for _, n in workload)
        g = llm.engine.nodes["local-0"].runner.geometry   # type: ignore[attr-defined]
        block_bytes = g.num_layers * g.block_size * g.bytes_per_token
        our_kv = int(o["peak_blocks"]) * block_bytes
        same = sum(a == b for a, b in zip(o["outputs"], t.outputs))   # type: ignore[arg-type]
        print(f"# bench_engine  model llama {count_parameters(model_dir) / 1e6:.1f}M fp32 {args.device}, torch threads "
              f"{torch.get_num_threads()}, {args.requests} requests, {requested} requested tokens, "
              f"best of {args.repeats}")
        tput_o, tput_t = requested / o["seconds"], requested / t.seconds   # type: ignore[operator]
        tput_b = requested / min(r.seconds for r in bare)
        print(f"throughput   pagedkv LLM {tput_o:7.1f} tok/s | transformers {tput_t:7.1f} tok/s | "
              f"ratio {tput_o / tput_t:.2f}x (target >= 2x) | the model runner alone under a minimal loop "
              f"{tput_b:7.1f} tok/s (engine / runner {tput_o / tput_b:.2f})")
        print(f"peak KV      pagedkv {our_kv / 2**20:7.1f} MiB | transformers {t.cache_bytes / 2**20:7.1f} MiB | "
              f"ratio {our_kv / t.cache_bytes:.2f}x (target <= 0.5x)")
        bo, bt = min(b1_ours), min(b1_theirs)
        print(f"batch-1 step pagedkv {1e3 * bo:6.1f} ms | transformers {1e3 * bt:6.1f} ms | ratio {bo / bt:.2f}x "
              f"(target <= 1.2x)")
        print(f"greedy outputs identical to transformers: {same}/{len(workload)}")
        s = decode_split(llm, args.split_batch, 16)
        model = s["dense"] + s["sample"] + s["prepare"]
        other = s["step"] - s["bm"] - s["node"]
        overhead = s["step"] - model - s["attention"]
        print(f"decode step at batch {args.split_batch}: {1e3 * s['step']:.1f} ms = model {1e3 * model:.1f} "
              f"(dense {1e3 * s['dense']:.1f}, sampling {1e3 * s['sample']:.2f}, batch prep {1e3 * s['prepare']:.2f}) "
              f"+ attention kernels {1e3 * s['attention']:.1f} + block manager {1e3 * s['bm']:.2f} + node "
              f"rest {1e3 * (s['node'] - model - s['attention']):.2f} + engine {1e3 * other:.2f} ms; "
              f"engine overhead {100 * overhead / s['step']:.1f}% of the step (target <= 10%)"
              + ("; async scheduling on: the node's phases overlap the engine's step, so these parts do not"
                 " add up to it" if llm.engine.config.async_scheduling else ""))
        llm.close()


if __name__ == "__main__":
    main()
