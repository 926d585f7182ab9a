"""Per-layer CPU attention of a model step: the per-kernel calls vs the step kernel (issue 21).

The attention a CPU model step runs per layer, on a SmolLM-135M-shaped pool (9 query / 3 KV
heads, head dim 64, fp32, block size 16, 30 layers): either the generic calls (`KvPool.write`,
then the decode and prefill kernels through `kernels`' validating dispatcher: what the runner
did before) or `StepAttention.run` (one compiled call per layer after a once-per-step
`KvPool.begin_cpu_step`). Both through `compute_node.model.attention.paged_attention`, so the
Python around them is the model's. Each step shape alternates the two paths `--repeats` times
over all layers; printed: median per layer of wall time and of this thread's CPU time (the
small steps run on this thread, so its CPU time is what they cost even when other processes
share the cores), and the step's one-off `begin_cpu_step` cost.

    .venv/bin/python bench/bench_cpu_step.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compute_node.decode_path import StepShape  # noqa: E402
from compute_node.model.attention import AttentionMetadata, paged_attention  # noqa: E402
from compute_node.pool import KvPool, PoolGeometry  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def metadata(pool: KvPool, decode_lens: list[int], prefill: list[tuple[int, int]], fused: bool) -> AttentionMetadata:
    """Decode sequences (one token each) then prefill chunks (seq_len, q_len), disjoint tables."""
    lens = decode_lens + [s for s, _ in prefill]
    q_lens = [1] * len(decode_lens) + [q for _, q in prefill]
    width = -(-max(lens) // BLOCK)
    tables = np.arange(len(lens) * width, dtype=np.int32).reshape(len(lens), width)
    positions = [np.arange(n - q, n) for n, q in zip(lens, q_lens)]
    slots = np.concatenate([tables[i, p // BLOCK].astype(np.int64) * BLOCK + p % BLOCK
                            for i, p in enumerate(positions)])
    nd = len(decode_lens)
    t = torch.from_numpy
    meta = AttentionMetadata(
        slot_mapping=t(slots), num_decode_tokens=nd,
        decode_block_tables=t(np.ascontiguousarray(tables[:nd])) if nd else None,
        decode_seq_lens=t(np.array(lens[:nd], np.int32)) if nd else None,
        prefill_block_tables=t(np.ascontiguousarray(tables[nd:])) if prefill else None,
        prefill_seq_lens=t(np.array(lens[nd:], np.int32)) if prefill else None,
        prefill_query_start_loc=t(np.concatenate([[0], np.cumsum(q_lens[nd:])]).astype(np.int32)) if prefill else None,
        scale=HEAD_DIM**-0.5, prefill_max_query_len=max(q_lens[nd:]) if prefill else None,
    )
    if fused:
        meta.cpu_step = pool.begin_cpu_step(
            num_heads=HEADS, slot_mapping=meta.slot_mapping, num_decode_tokens=nd,
            decode_block_tables=meta.decode_block_tables, decode_seq_lens=meta.decode_seq_lens,
            prefill_block_tables=meta.prefill_block_tables, prefill_seq_lens=meta.prefill_seq_lens,
            prefill_query_start_loc=meta.prefill_query_start_loc, scale=meta.scale)
    elif nd:
        meta.decode = pool.begin_decode(meta.decode_block_tables, meta.decode_seq_lens,
                                        StepShape(HEADS, torch.float32, meta.scale))
    return meta


def one_step(pool: KvPool, decode_lens: list[int], prefill: list[tuple[int, int]], fused: bool,
             q: torch.Tensor, kv: torch.Tensor) -> tuple[float, float, float]:
    """(wall s, thread CPU s) of every layer's attention, and the metadata's build time."""
    t0 = time.perf_counter()
    meta = metadata(pool, decode_lens, prefill, fused)
    begin = time.perf_counter() - t0
    wall, cpu = time.perf_counter(), time.thread_time()
    for layer in range(LAYERS):
        paged_attention(pool, layer, q, kv, kv, meta)
    return time.perf_counter() - wall, time.thread_time() - cpu, begin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    shapes = {
        "decode b=1, ctx 128": ([129], []),
        "decode b=8, ctx 128": ([129] * 8, []),
        "decode b=8 ctx 16-512 + prefill 256 onto 256": ([17, 60, 129, 200, 260, 330, 400, 513], [(512, 256)]),
    }
    pool = KvPool(PoolGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", BLOCK, 600), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_cpu_step: {LAYERS} layers, {HEADS}/{KV_HEADS} heads, head dim {HEAD_DIM}, fp32, block {BLOCK}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {when}")
    print("| step | path | wall µs/layer | thread CPU µs/layer | per-step setup µs | CPU ratio |")
    print("|---|---|---|---|---|---|")
    for name, (decode_lens, prefill) in shapes.items():
        num_tokens = len(decode_lens) + sum(q for _, q in prefill)
        q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
        kv = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
        runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for fused in (False, True):   # warm-up: compile or load the kernels
            one_step(pool, decode_lens, prefill, fused, q, kv)
        for rep in range(args.repeats):
            for fused in ((False, True) if rep % 2 == 0 else (True, False)):
                runs[fused].append(one_step(pool, decode_lens, prefill, fused, q, kv))
        cpu = {}
        for fused in (False, True):
            wall_us = 1e6 * statistics.median(r[0] for r in runs[fused]) / LAYERS
            cpu[fused] = 1e6 * statistics.median(r[1] for r in runs[fused]) / LAYERS
            setup = f"{1e6 * statistics.median(r[2] for r in runs[fused]):.0f}" if fused else "–"
            ratio = f"**{cpu[False] / cpu[True]:.1f}x** less" if fused else "1.0x"
            print(f"| {name} | {'step kernel' if fused else 'per-kernel calls'} | {wall_us:.0f} | {cpu[fused]:.0f} | "
                  f"{setup} | {ratio} |")


if __name__ == "__main__":
    main()
