"""Model runner benchmark (issue 12): `ModelRunner` with continuous batching vs transformers
`generate`, CPU, float32, the demo's ~54M-parameter random-weight Llama (built in a temp dir).

Three measurements, each ours and theirs in the same process, alternating `--repeats` times and
keeping each side's fastest run (ratios; the machine is shared and other work slows any run):
1. Throughput on a batch workload: `--requests` requests, prompts uniform in [16, 512] tokens,
   outputs uniform in [16, 128], greedy, EOS ignored. Ours: a minimal scheduler loop in this
   file over the runner — every step decodes all running sequences and fills the rest of a
   token budget with prefill chunks of waiting ones (continuous batching, chunked prefill); a
   sequence's blocks return to the free list when it finishes. Theirs: one `generate` call
   over all requests, left-padded, its default dynamic cache, `max_new_tokens` = the longest
   output (a static batch cannot stop a row early). Tokens/s counts the tokens the requests
   asked for (sum of output lengths) in both; the table also shows transformers' raw rate.
2. KV memory: ours = peak blocks in use x bytes per block; theirs = the bytes of the dynamic
   cache's tensors at the end of `generate`.
3. Batch-1 decode latency: median step of ours vs transformers' per-token time
   ((time of N+1 new tokens - time of 1) / N) after a `--b1-context`-token prompt.
Wall and CPU time (all threads) are both shown: on a shared machine wall time also counts waiting
for a core. Plus the per-step time split of our decode steps at the full batch (dense / attention kernels /
sampling / host). Greedy outputs are compared with transformers' (sanity, not a gate).

    .venv/bin/python bench/bench_model.py [--requests 32] [--budget 2048] [--block-size 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compute_node.model import ModelRunner, SamplingParams, SeqWork, StepTimings
from compute_node.model.tiny import build_tiny_model, count_parameters

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Seq:
    index: int
    prompt: list[int]
    max_tokens: int
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


def cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class OurRun:
    seconds: float
    cpu_s: float
    outputs: list[list[int]]
    peak_blocks: int
    num_steps: int


def make_workload(num_requests: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(16, 512))], rng.randint(16, 128))
            for _ in range(num_requests)]


def run_ours(runner: ModelRunner, workload: list[tuple[list[int], int]], budget: int) -> OurRun:
    """Continuous batching: decodes first, then prefill chunks up to `budget` tokens a step."""
    bs = runner.geometry.block_size
    free = list(range(runner.geometry.num_blocks))
    waiting = [Seq(i, p, n) for i, (p, n) in enumerate(workload)]
    running: list[Seq] = []
    outputs: list[list[int]] = [[] for _ in workload]
    peak = steps = 0
    started, cpu_started = time.perf_counter(), cpu_seconds()
    while waiting or running:
        batch: list[SeqWork] = []
        owners: list[Seq] = []
        tokens_left = budget
        for s in running + waiting:
            if tokens_left == 0:
                break
            if s.prefilling:
                new = s.prompt[s.num_computed: s.num_computed + tokens_left]
            else:
                new = s.output[-1:]
            need = -(-(s.num_computed + len(new)) // bs) - len(s.table)
            if need > len(free):
                break   # out of blocks: wait for finished sequences (no preemption needed here)
            s.table += [free.pop() for _ in range(need)]
            if s in waiting:
                waiting.remove(s)
                running.append(s)
            last_chunk = s.num_computed + len(new) >= len(s.prompt)
            batch.append(SeqWork(str(s.index), new, s.num_computed, s.table, GREEDY if last_chunk else None,
                                 len(s.output)))
            owners.append(s)
            tokens_left -= len(new)
        peak = max(peak, runner.geometry.num_blocks - len(free))
        results = runner.execute(batch)
        steps += 1
        for s, work, out in zip(owners, batch, results):
            s.num_computed += len(work.token_ids)
            if out is not None:
                s.output.append(out.token_id)
            if len(s.output) >= s.max_tokens:
                running.remove(s)
                free.extend(s.table)
                outputs[s.index] = s.output
    seconds = time.perf_counter() - started
    return OurRun(seconds, cpu_seconds() - cpu_started, outputs, peak, steps)


@dataclass
class DecodeSplit:
    timings: list[StepTimings]
    torch_op_share: float   # fraction of the dense phase spent in aten ops (torch.profiler)


def decode_split(runner: ModelRunner, workload: list[tuple[list[int], int]], steps: int = 12) -> DecodeSplit:
    """Prefill every prompt, then time decode steps with the whole workload as one batch."""
    from torch.profiler import ProfilerActivity, profile

    bs = runner.geometry.block_size
    free = list(range(runner.geometry.num_blocks))
    seqs: list[list] = []
    for i, (prompt, _) in enumerate(workload):
        table = [free.pop() for _ in range(-(-(len(prompt) + steps + 8) // bs))]
        out = runner.execute([SeqWork(str(i), prompt, 0, table, GREEDY)])[0]
        seqs.append([str(i), out.token_id if out else 0, len(prompt), table])

    def step(k: int) -> None:
        outs = runner.execute([SeqWork(s[0], [s[1]], s[2], s[3], GREEDY, k) for s in seqs])
        for s, out in zip(seqs, outs):
            s[1], s[2] = (out.token_id if out else 0), s[2] + 1

    runner.profile = True
    timings = []
    for k in range(steps - 3):
        step(k + 1)
        if k >= 2 and runner.last_timings is not None:
            timings.append(runner.last_timings)
    profiled_dense = 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps - 3, steps):
            step(k + 1)
            profiled_dense += runner.last_timings.dense_s if runner.last_timings is not None else 0.0
    runner.profile = False
    # aten ops of the dense phase: everything but the sampler's argmax and the index building.
    dense_ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::")) and e.key != "aten::argmax"]
    aten_s = sum(e.self_cpu_time_total for e in dense_ops) / 1e6
    # The torch-op share of the dense phase, from the same (profiled) steps.
    return DecodeSplit(timings, min(1.0, aten_s / profiled_dense) if profiled_dense else 1.0)


@dataclass
class TheirRun:
    seconds: float
    cpu_s: float
    outputs: list[list[int]]
    cache_bytes: int


def run_transformers(hf: object, workload: list[tuple[list[int], int]], pad_id: int) -> TheirRun:
    longest = max(len(p) for p, _ in workload)
    max_new = max(n for _, n in workload)
    ids = torch.full((len(workload), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(workload):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    device = getattr(hf, "device", "cpu")
    ids, mask = ids.to(device), mask.to(device)
    started, cpu_started = time.perf_counter(), cpu_seconds()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,  # type: ignore[attr-defined]
                          do_sample=False, eos_token_id=None, pad_token_id=pad_id, return_dict_in_generate=True)
    seconds, cpu_s = time.perf_counter() - started, cpu_seconds() - cpu_started
    generated = out.sequences[:, longest:].tolist()
    cache_bytes = 0
    for layer in out.past_key_values.layers:
        cache_bytes += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return TheirRun(seconds, cpu_s, [g[:n] for g, (_, n) in zip(generated, workload)], cache_bytes)


def decode_latency_ours(runner: ModelRunner, context: int, steps: int) -> float:
    bs = runner.geometry.block_size
    prompt = [5 + i % 1000 for i in range(context)]
    table = list(range(-(-(context + steps) // bs)))
    out = runner.execute([SeqWork("b1", prompt, 0, table, GREEDY)])[0]
    times = []
    token, n = (out.token_id if out else 0), context
    for k in range(steps):
        t = time.perf_counter()
        out = runner.execute([SeqWork("b1", [token], n, table, GREEDY, k + 1)])[0]
        times.append(time.perf_counter() - t)
        token, n = (out.token_id if out else 0), n + 1
    return statistics.median(times[3:])


def decode_latency_transformers(hf: object, context: int, steps: int, repeats: int = 3) -> float:
    ids = torch.tensor([[5 + i % 1000 for i in range(context)]]).to(getattr(hf, "device", "cpu"))
    per_token = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=1)  # type: ignore[attr-defined]
            one = time.perf_counter() - t
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,  # type: ignore[attr-defined]
                        eos_token_id=None, pad_token_id=1)
            per_token.append((time.perf_counter() - t - one) / steps)
    return statistics.median(per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2048, help="tokens per step (ours)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--b1-context", type=int, default=256)
    parser.add_argument("--b1-steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternate ours/theirs this many times and keep each side's fastest run "
                             "(the machine is shared: the fastest run is the least disturbed one)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", "llama", seed=args.seed)
        num_params = count_parameters(model_dir)
        workload = make_workload(args.requests, 8192, args.seed)
        max_len = max(len(p) + n for p, n in workload)
        num_blocks = args.requests * -(-max_len // args.block_size) + 64
        runner = ModelRunner(model_dir, block_size=args.block_size, num_blocks=num_blocks, device="cpu")
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # Warm-up both (Numba kernels from cache, oneDNN primitives, allocator).
        run_ours(runner, make_workload(2, 8192, 99), args.budget)
        run_transformers(hf, make_workload(2, 8192, 99), 1)

        our_runs, their_runs, b1_ours_runs, b1_hf_runs = [], [], [], []
        for _ in range(args.repeats):
            our_runs.append(run_ours(runner, workload, args.budget))
            their_runs.append(run_transformers(hf, workload, 1))
            b1_ours_runs.append(decode_latency_ours(runner, args.b1_context, args.b1_steps))
            b1_hf_runs.append(decode_latency_transformers(hf, args.b1_context, args.b1_steps))
        split = decode_split(runner, workload)
    ours = min(our_runs, key=lambda r: r.seconds)
    theirs = min(their_runs, key=lambda r: r.seconds)
    b1_ours, b1_hf = min(b1_ours_runs), min(b1_hf_runs)
    print("runs (wall s, ours / theirs): " + ", ".join(f"{a.seconds:.1f} / {b.seconds:.1f}"
                                                        for a, b in zip(our_runs, their_runs)))

    useful = sum(n for _, n in workload)
    raw_hf = len(workload) * max(n for _, n in workload)
    ours_kv = ours.peak_blocks * runner.geometry.bytes_per_block
    hf_s, hf_cache_bytes = theirs.seconds, theirs.cache_bytes
    same = sum(a == b for a, b in zip(ours.outputs, theirs.outputs))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(ours.outputs, theirs.outputs)]
    print(f"best of {args.repeats} alternating runs per side; model: llama {num_params / 1e6:.1f}M params, fp32, "
          f"CPU, torch threads {torch.get_num_threads()}; "
          f"{len(workload)} requests, prompts {sum(len(p) for p, _ in workload)} tokens, outputs {useful} tokens")
    print(f"ours: {ours.num_steps} steps, budget {args.budget} tokens/step, block size {args.block_size}")
    print()
    print("| metric | ours | transformers | ratio (ours / theirs) | target |")
    print("|---|---|---|---|---|")
    print(f"| throughput, requested tokens/s | {useful / ours.seconds:.1f} | {useful / hf_s:.1f} | "
          f"{hf_s / ours.seconds:.2f}x | >= 2x |")
    print(f"| wall time of the workload, s | {ours.seconds:.1f} | {hf_s:.1f} | | |")
    print(f"| CPU time of the workload (all threads), s | {ours.cpu_s:.1f} | {theirs.cpu_s:.1f} | "
          f"{ours.cpu_s / theirs.cpu_s:.2f}x | |")
    print(f"| transformers raw rate (all {raw_hf} generated tokens)/s | | {raw_hf / hf_s:.1f} | | |")
    print(f"| peak KV memory, MiB | {ours_kv / 2**20:.1f} | {hf_cache_bytes / 2**20:.1f} | "
          f"{ours_kv / hf_cache_bytes:.2f}x | <= 0.5x |")
    print(f"| batch-1 decode step, ms ({args.b1_context}-token context) | {b1_ours * 1e3:.2f} | {b1_hf * 1e3:.2f} | "
          f"{b1_ours / b1_hf:.2f}x | <= 1.2x |")
    print(f"| greedy outputs identical to transformers' | {same}/{len(workload)} | | | |")
    print(f"| mean identical prefix, tokens | {statistics.mean(prefix):.1f} of {useful / len(workload):.1f} | | | |")
    mean = {k: statistics.mean(getattr(t, k) for t in split.timings) * 1e3
            for k in ("dense_s", "attention_s", "sample_s", "prepare_s", "host_s", "total_s")}
    torch_ops = split.torch_op_share * mean["dense_s"]
    print()
    print(f"Our decode step at batch {len(workload)} (mean of {len(split.timings)} steps; torch-op share of the "
          f"dense phase from torch.profiler over 3 more steps), ms:")
    print("| dense: torch ops | dense: Python layer loop | attention kernels (write + decode) | sampling | "
          "batch prep (host) | other host | total |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {torch_ops:.2f} | {mean['dense_s'] - torch_ops:.2f} | {mean['attention_s']:.2f} | "
          f"{mean['sample_s']:.2f} | {mean['prepare_s']:.2f} | {mean['host_s']:.2f} | {mean['total_s']:.2f} |")

if __name__ == "__main__":
    main()
