"""The time any engine needs for a `vllm_workloads` workload on this machine, from the work
alone: how far each side of `bench_vs_vllm.py` is from the hardware, and whether a ratio
between two engines is still reachable (two engines both at 85% of the roofline cannot be
1.2x apart). Stdlib only, like `vllm_workloads.py` (only `measure_machine` imports torch).

The model's work is counted from its shape (float32 weights, the layers' matmuls, attention
as two products over the context, the LM head once per generated token), with ideal prefix
caching: a prompt position is computed once however many prompts share the prefix up to it
(the positions of a trie of the prompts), and a shared prefix's K/V is read once per decode
step. Steps run one after another, as they must (each decode token depends on the last):

- prefill: its FLOPs at the machine's matmul peak (it is compute-bound at these sizes);
- each decode step: the longer of reading the weights and the K/V of its contexts at the
  one-row read rate, and its FLOPs at the matmul peak (at 24-32 rows the small models are
  compute-bound, at one row memory-bound).

What it leaves out makes it a floor, not a forecast: elementwise work, sampling, the engine's
own host time, and any matmul below the peak rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_workloads import Request, Shape

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Machine:
    """What the roofline divides by: measured on this machine (`measure_machine`)."""

    peak_flops: float         # float32 multiply-adds x 2 per second, a large matmul on every core
    read_bytes_per_s: float   # weights streamed by a one-row matmul (a decode step of one sequence)


@dataclass(frozen=True)
class DecodeStep:
    rows: int                 # sequences decoding in this step
    flops: float
    bytes_read: float         # weights once + the K/V of the distinct context positions


@dataclass(frozen=True)
class Work:
    prefill_flops: float
    decode_steps: tuple[DecodeStep, ...]
    output_tokens: int


def _params(shape: Shape) -> tuple[int, int]:
    """(parameters of the transformer layers' matmuls, parameters of the LM head)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * shape.intermediate_size
    return per_layer * shape.num_layers, h * shape.vocab_size


def trie_positions(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Every distinct prompt prefix, as its length (1..len): the positions a prefill must
    compute once with ideal prefix caching (a shared prefix counts once)."""
    root: dict[int, dict] = {}
    lengths = []
    for p in prompts:
        node = root
        for i, t in enumerate(p, start=1):
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                lengths.append(i)
            node = child
    return lengths


def count_work(shape: Shape, requests: Sequence[Request]) -> Work:
    """The work of `requests` (prompt ids, new tokens) on `shape`: see the module docstring."""
    dense, head = _params(shape)
    attn_per_key = 4 * shape.num_layers * shape.num_heads * shape.head_dim     # QK^T and PV
    kv_bytes_per_pos = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * FLOAT32_BYTES
    positions = trie_positions([p for p, _ in requests])
    prefill = sum(2 * dense + attn_per_key * i for i in positions) + 2 * head * len(requests)
    # a request's first token comes from its prefill; each later one is a decode step
    order = sorted(requests, key=lambda r: r[1], reverse=True)
    steps = []
    prompt_positions: dict[int, int] = {}     # by number of running requests (a prefix of `order`)
    for s in range(1, order[0][1] if order else 0):
        running = [r for r in order if r[1] > s]
        if len(running) not in prompt_positions:
            prompt_positions[len(running)] = len(trie_positions([p for p, _ in running]))
        distinct = prompt_positions[len(running)] + s * len(running)
        flops = sum(2 * (dense + head) + attn_per_key * (len(p) + s) for p, _ in running)
        steps.append(DecodeStep(len(running), flops, (dense + head) * FLOAT32_BYTES + distinct * kv_bytes_per_pos))
    return Work(prefill, tuple(steps), sum(n for _, n in requests))


def roofline_seconds(work: Work, machine: Machine) -> float:
    decode = sum(max(s.bytes_read / machine.read_bytes_per_s, s.flops / machine.peak_flops)
                 for s in work.decode_steps)
    return work.prefill_flops / machine.peak_flops + decode


def roofline_tok_per_s(shape: Shape, requests: Sequence[Request], machine: Machine) -> float:
    work = count_work(shape, requests)
    return work.output_tokens / roofline_seconds(work, machine)


def fma_peak_flops() -> float | None:
    """The float32 FMA peak from /proc/cpuinfo (x86 with FMA: two FMA pipes of 8 lanes with
    AVX2, 16 with AVX-512, x 2 FLOPs, x cores x clock), None where it cannot be read."""
    import os

    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    mhz = [float(line.split(":", 1)[1]) for line in info.splitlines() if line.startswith("cpu MHz")]
    if "fma" not in flags or not mhz:
        return None
    lanes = 16 if "avx512f" in flags else 8
    return 2 * lanes * 2 * (os.cpu_count() or 1) * max(mhz) * 1e6


def measure_machine(repeats: int = 5) -> Machine:
    """The matmul peak: the FMA peak from the CPU's flags and clock, or (where that cannot be
    read, or a 512 x 2048 x 8192 float32 matmul beats it) the matmul's rate; the read rate:
    the best of a one-row matmul and a sum over 256 MiB of float32 (a decode step of one
    sequence reads its weights once), best of `repeats`, on torch's default threads (every core).
    Measured rates are what torch reaches: a kernel of our own may beat them, so a share of
    the roofline a little over 1 means the measured rate, not the hardware, was the bound."""
    import time

    import torch

    a, b = torch.randn(512, 2048), torch.randn(2048, 8192)
    x, w = torch.randn(1, 8192), torch.randn(8192, 8192)       # 256 MiB of float32 weights
    best_mm = best_read = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best_mm = min(best_mm, time.perf_counter() - t)
        for read in (lambda: torch.mm(x, w), w.sum):
            t = time.perf_counter()
            read()
            best_read = min(best_read, time.perf_counter() - t)
    measured = 2 * 512 * 2048 * 8192 / best_mm
    return Machine(max(measured, fma_peak_flops() or 0.0), w.numel() * FLOAT32_BYTES / best_read)
