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

`--compare-tree DIR` (issue 21, prefill kernel): instead, the step kernel of this checkout vs
the one of another checkout (e.g. `git archive main | tar -x -C DIR`: the kernel before a
change) on the prefill-carrying steps, in child processes that alternate (one process cannot
import two versions of `kernels`), plus torch's `scaled_dot_product_attention` on the same
queries and K/V gathered from the pages into contiguous tensors (what transformers' prefill
calls; the cost of the gather included). Per row: median wall and process CPU time per layer over
`--repeats` runs in each of `--rounds` processes per tree, and the attention multiply-adds per
second of CPU.

    .venv/bin/python bench/bench_cpu_step.py [--repeats 15] [--compare-tree DIR [--rounds 3] [--threads N]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
# A `--child` process imports the checkout named by BENCH_TREE (see --compare-tree).
sys.path.insert(0, os.environ.get("BENCH_TREE", str(REPO)))

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


# Prefill-carrying steps of the engine vs transformers workload (bench_modes' hf part: the first
# step is a 2,048-token batch of whole prompts; chunks onto cached prefixes follow) and the
# mixed step above. (decode lens, [(seq_len, q_len)]).
PREFILL_SHAPES: dict[str, tuple[list[int], list[tuple[int, int]]]] = {
    "prefill 256 onto 256": ([], [(512, 256)]),
    "prefill 8 prompts 84-467 (2,048 tokens)": ([], [(84, 84), (467, 467), (148, 148), (454, 454), (176, 176),
                                                     (449, 449), (261, 261), (9, 9)]),
    "decode b=8 ctx 16-512 + prefill 256 onto 256": ([17, 60, 129, 200, 260, 330, 400, 513], [(512, 256)]),
}


def prefill_macs(prefill: list[tuple[int, int]]) -> int:
    """Multiply-adds of causal attention (scores and values) over the prefill chunks."""
    keys = sum(q * (s - q) + q * (q + 1) // 2 for s, q in prefill)
    return 2 * keys * HEADS * HEAD_DIM


def sdpa_step(pool: KvPool, prefill: list[tuple[int, int]], q: torch.Tensor, meta: AttentionMetadata) -> None:
    """torch SDPA over every prefill chunk of one layer: K/V gathered from the pages (layer 0's),
    a bottom-right-aligned causal mask (chunk onto a cached prefix), GQA by expansion."""
    tables, starts = meta.prefill_block_tables, meta.prefill_query_start_loc
    kc, vc = pool.key_caches[0], pool.value_caches[0]
    nd = meta.num_decode_tokens
    for i, (seq_len, q_len) in enumerate(prefill):
        blocks = tables[i, :-(-seq_len // BLOCK)].long()
        k = kc[blocks].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :seq_len]
        v = vc[blocks].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :seq_len]
        rows = q[nd + int(starts[i]):nd + int(starts[i + 1])].transpose(0, 1)
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=meta.scale,
                                                         enable_gqa=True)


def child(repeats: int, threads: int | None) -> None:
    """One process's measurements of PREFILL_SHAPES (JSON on stdout): this tree's step kernel
    and, per shape, torch SDPA, alternating; (wall s, process CPU s) per run of 30 layers (the
    process does nothing else, so its CPU time is what the attention cost on all its threads;
    the metadata build of a run is included, ~1 ms). `threads`: Numba's and torch's thread
    counts (one thread: CPU time without any spin-waiting of idle workers)."""
    if threads:
        import numba

        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
    pool = KvPool(PoolGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", BLOCK, 600), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (decode_lens, prefill) in PREFILL_SHAPES.items():
        num_tokens = len(decode_lens) + sum(q for _, q in prefill)
        q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
        kv = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
        meta = metadata(pool, decode_lens, prefill, False)
        sdpa_step(pool, prefill, q, meta)
        one_step(pool, decode_lens, prefill, True, q, kv)   # warm-up
        runs, sdpa = [], []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            one_step(pool, decode_lens, prefill, True, q, kv)
            runs.append((time.perf_counter() - wall, time.process_time() - cpu))
            wall, cpu = time.perf_counter(), time.process_time()
            for _layer in range(LAYERS):
                sdpa_step(pool, prefill, q, meta)
            sdpa.append((time.perf_counter() - wall, time.process_time() - cpu))
        out[name] = {"step": runs, "sdpa": sdpa}
    print(json.dumps(out))


def compare_trees(args: argparse.Namespace) -> None:
    """This checkout's step kernel vs `--compare-tree`'s, alternating child processes."""
    trees = {"this checkout": REPO, f"{args.compare_tree}": args.compare_tree.resolve()}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    loads = []
    for rnd in range(args.rounds):
        for name in (list(trees) if rnd % 2 == 0 else list(reversed(trees))):
            loads.append(os.getloadavg()[0])
            env = dict(os.environ, BENCH_TREE=str(trees[name]))
            command = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
            command += ["--threads", str(args.threads)] if args.threads else []
            done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_cpu_step --compare-tree: {LAYERS} layers, {HEADS}/{KV_HEADS} heads, head dim {HEAD_DIM}, fp32, "
          f"block {BLOCK}; {os.cpu_count()} cores, load {min(loads):.1f}-{max(loads):.1f}; {args.rounds} rounds x "
          f"{args.repeats} repeats; threads {args.threads or 'all'}; {when}")
    print("| step | attention | wall ms/layer | process CPU ms/layer | G multiply-adds per CPU-s | vs before (CPU) |")
    print("|---|---|---|---|---|---|")
    for shape, (_, prefill) in PREFILL_SHAPES.items():
        rows = {}
        for name in trees:
            rows[f"step kernel, {name}"] = [r for res in results[name] for r in res[shape]["step"]]
        rows["torch SDPA (gathered K/V)"] = [r for res in results["this checkout"] for r in res[shape]["sdpa"]]
        before = statistics.median(r[1] for r in rows[f"step kernel, {args.compare_tree}"])
        for label, runs in rows.items():
            wall = 1e3 * statistics.median(r[0] for r in runs) / LAYERS
            cpu = statistics.median(r[1] for r in runs)
            rate = prefill_macs(prefill) * LAYERS / cpu / 1e9
            print(f"| {shape} | {label} | {wall:.2f} | {1e3 * cpu / LAYERS:.2f} | {rate:.1f} | {before / cpu:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compare-tree", type=Path, default=None, help="another checkout's step kernel, side by side")
    ap.add_argument("--rounds", type=int, default=3, help="child processes per tree (--compare-tree)")
    ap.add_argument("--threads", type=int, default=None, help="Numba and torch threads (--compare-tree children)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.repeats, args.threads)
        return
    if args.compare_tree is not None:
        compare_trees(args)
        return
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
