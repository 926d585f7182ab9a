"""The engine on a real-size bf16 model vs transformers and vs the physical floor (review §4.3
items 14-15; issue 43's engine targets).

One model per call (`gpu_model.LLAMA_1B`, or `LLAMA_8B_LAYERS` for the d128 kernels), random
weights, built in a temporary directory. Ours: `pagedkv.LLM` (embedded block manager, CUDA
graphs for decode attention, async scheduling as `LLM` picks it on a GPU) on `num_requests`
requests, prompts U[256, 2048], outputs U[64, 256], greedy, EOS ignored, all submitted at
once; throughput, time to first token (from submission, so it includes queueing behind the
other requests' prefill) and inter-token latency p50/p99 from the steps' outputs. Theirs: transformers
`generate` (bf16, SDPA) over the same requests left-padded in one batch (in slices of 32 if
one batch does not fit). Then:

- batch-1 decode step at a 1024-token context, ours vs transformers' per-token time vs the
  floor (weights read once per step ÷ the run's copy bandwidth; target <= 1.3x);
- batch-64 decode step at 1024-token contexts vs the floor (weights + every sequence's K/V;
  target <= 1.5x), and the step's split (dense, attention, sampling, block manager, engine)
  with the share that is neither model nor kernels (target <= 10%).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_model import ModelShape, build_random_model, step_floor_us, workload


@dataclass(frozen=True, slots=True)
class EngineSizes:
    num_requests: int = 128
    prompt_range: tuple[int, int] = (256, 2048)
    output_range: tuple[int, int] = (64, 256)
    budget_tokens: int = 8192  # max_num_batched_tokens
    b1_context: int = 1024
    b1_steps: int = 32
    big_batch: int = 64
    big_context: int = 1024
    big_steps: int = 16
    hf_slice: int = 32  # transformers' batch when the whole workload does not fit


SMOKE_ENGINE = EngineSizes(num_requests=3, prompt_range=(8, 24), output_range=(3, 6),
                           budget_tokens=256, b1_context=16, b1_steps=4, big_batch=4,
                           big_context=16, big_steps=4, hf_slice=2)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_timed(llm: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Serve `requests` through the engine's step loop; throughput and per-request latencies
    (a step's outputs carry each request's tokens so far: a growth of k tokens after a gap
    of t counts as k inter-token gaps of t / k)."""
    from engine.params import SamplingParams

    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for p, n in requests]
    started = time.perf_counter()
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    gaps: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            before = seen.get(o.request_id, 0)
            if n > before:
                if before == 0:
                    ttft.append(now - started)
                    before = 1
                if n > before:
                    gaps += [(now - last[o.request_id]) / (n - before)] * (n - before)
                seen[o.request_id] = n
                last[o.request_id] = now
    seconds = time.perf_counter() - started
    engine.flush()
    tokens = sum(n for _, n in requests)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": 1e3 * (percentile(ttft, 0.5) or 0.0),
            "ttft_p99_ms": 1e3 * (percentile(ttft, 0.99) or 0.0),
            "itl_p50_ms": 1e3 * (percentile(gaps, 0.5) or 0.0),
            "itl_p99_ms": 1e3 * (percentile(gaps, 0.99) or 0.0),
            "requests_done": sum(seen.get(i, 0) > 0 for i in ids)}


def steady_step_s(llm: Any, batch: int, prompt_len: int, steps: int) -> float:
    """Median wall time of a decode step with `batch` sequences running (profiling off)."""
    from engine.params import SamplingParams

    engine = llm.engine
    # warm-up: admissions and every prompt's prefill; outputs long enough that no sequence
    # finishes (and the batch shrinks) inside the timed steps
    warm = 4 + -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    for i in range(batch):
        engine.add_request([5 + (i * 13 + j) % 4000 for j in range(prompt_len)],
                           SamplingParams(temperature=0, max_tokens=warm + steps + 8,
                                          ignore_eos=True))
    for _ in range(warm):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    return statistics.median(times)


def transformers_run(model_dir: Path, device: str, requests: list[tuple[list[int], int]],
                     warm_up: list[tuple[list[int], int]], sizes: EngineSizes) -> dict[str, Any]:
    """transformers bf16 `generate` (SDPA) over the requests, and its batch-1 per-token time."""
    import torch
    from bench_model import decode_latency_transformers, run_transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").eval().to(device)
    run_transformers(hf, warm_up, 1)
    slices = [requests]
    try:
        runs = [run_transformers(hf, requests, 1)]
    except torch.OutOfMemoryError:
        if device == "cuda":
            torch.cuda.empty_cache()
        slices = [requests[i:i + sizes.hf_slice] for i in range(0, len(requests), sizes.hf_slice)]
        runs = [run_transformers(hf, part, 1) for part in slices]
    seconds = sum(r.seconds for r in runs)
    tokens = sum(n for _, n in requests)
    b1 = decode_latency_transformers(hf, sizes.b1_context, sizes.b1_steps, repeats=1)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"hf_seconds": seconds, "hf_tokens_per_s": tokens / seconds,
            "hf_batches": len(slices), "hf_b1_step_ms": 1e3 * b1}


def engine_cells(ctx: Any, shape: ModelShape, device: str, copy_gbs: float,
                 sizes: EngineSizes) -> None:
    """The phase: one row per measurement (module doc)."""
    import torch
    from bench_engine import batch1_itl, decode_split

    from engine.llm import LLM

    requests = workload(sizes.num_requests, sizes.prompt_range, sizes.output_range, shape.vocab)
    warm_up = [(p[:256], 8) for p, _ in requests[:2]]  # short: compiles, captures, loads
    max_len = max(len(p) + n for p, n in requests)
    max_len = max(max_len, sizes.big_context + sizes.big_steps + 16,
                  sizes.b1_context + sizes.b1_steps + 8)
    blocks = sizes.num_requests * -(-max_len // 16) + 64
    info: dict[str, Any] = {"model": shape.name, "params_m": shape.num_params() / 1e6,
                            "layers": shape.num_layers, "head_dim": shape.head_dim}
    with tempfile.TemporaryDirectory() as tmp:
        state: dict[str, Any] = {}

        def build() -> dict[str, Any]:
            t0 = time.perf_counter()
            state["dir"] = build_random_model(Path(tmp) / "model", shape, device,
                                              max_position_embeddings=max(8192, max_len))
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            state["llm"] = LLM(state["dir"], device=device, block_size=16, num_kv_blocks=blocks,
                               max_num_seqs=max(sizes.num_requests, sizes.big_batch),
                               max_num_batched_tokens=sizes.budget_tokens, max_model_len=max_len)
            init_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            run_timed(state["llm"], warm_up)  # first steps: JIT, graph captures
            return {**info, "what": "start-up", "build_s": build_s, "llm_init_s": init_s,
                    "first_requests_s": time.perf_counter() - t0}

        def serve() -> dict[str, Any]:
            ours = run_timed(state["llm"], requests)
            state["ours"] = ours
            return {**info, "what": f"{sizes.num_requests} requests", **ours}

        def batch1() -> dict[str, Any]:
            step = batch1_itl(state["llm"], sizes.b1_context, sizes.b1_steps)
            floor = step_floor_us(shape, copy_gbs, [sizes.b1_context])
            state["b1"] = step
            return {**info, "what": f"batch-1 step at {sizes.b1_context}", "step_ms": 1e3 * step,
                    "floor_ms": floor / 1e3, "vs_floor": step * 1e6 / floor, "target": "<= 1.3"}

        def batch_big() -> dict[str, Any]:
            llm, b, c = state["llm"], sizes.big_batch, sizes.big_context
            step = steady_step_s(llm, b, c, sizes.big_steps)
            floor = step_floor_us(shape, copy_gbs, [c + sizes.big_steps // 2] * b)
            split = decode_split(llm, b, sizes.big_steps, prompt_len=c)
            model = split["dense"] + split["sample"] + split["prepare"]
            host = split["step"] - model - split["attention"]
            return {**info, "what": f"batch-{b} step at {c}", "step_ms": 1e3 * step,
                    "floor_ms": floor / 1e3, "vs_floor": step * 1e6 / floor, "target": "<= 1.5",
                    "profiled_step_ms": 1e3 * split["step"], "dense_ms": 1e3 * split["dense"],
                    "attention_ms": 1e3 * split["attention"], "sample_ms": 1e3 * split["sample"],
                    "prepare_ms": 1e3 * split["prepare"], "block_manager_ms": 1e3 * split["bm"],
                    "engine_share": host / split["step"], "engine_share_target": "<= 0.10"}

        def theirs() -> dict[str, Any]:
            state.pop("llm").close()
            if device == "cuda":
                torch.cuda.empty_cache()
            hf = transformers_run(state["dir"], device, requests, warm_up, sizes)
            row = {**info, "what": "transformers bf16 generate (SDPA)", **hf}
            if "ours" in state:
                row["ours_vs_hf_throughput"] = state["ours"]["tokens_per_s"] / hf["hf_tokens_per_s"]
                row["throughput_target"] = ">= 3"
            if "b1" in state:
                row["ours_b1_vs_hf"] = 1e3 * state["b1"] / hf["hf_b1_step_ms"]
            return row

        try:
            if ctx.cell("start-up", build):
                ctx.cell("serve", serve)
                ctx.cell("batch-1 step", batch1)
                ctx.cell("big-batch step", batch_big)
                ctx.cell("transformers", theirs)
        finally:
            llm = state.pop("llm", None)
            if llm is not None:
                llm.close()
            if device == "cuda":
                torch.cuda.empty_cache()
