"""Benchmark the Numba CPU kernels: decode, prefill, write_slots, copy_blocks.

Prints tables. Decode is compared, in the same run, with (a) torch over contiguous K/V
(`scaled_dot_product_attention`, with and without the cost of gathering the paged blocks into
contiguous tensors) and (b) this machine's measured copy bandwidth: bytes of K/V read / kernel
time ÷ copy bandwidth. Every timing is the median of a bounded number of repetitions after a
warm-up call (which also triggers Numba compilation or loads it from the cache).

    .venv/bin/python bench/bench_kernels_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import numba
import numpy as np
import torch
import torch.nn.functional as F

import kernels
from kernels.cpu import decode as cpu_decode

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GROUP = NUM_HEADS // NUM_KV_HEADS


def timeit(fn: Callable[[], object], reps: int, budget_s: float = 20.0) -> float:
    """Median wall seconds per call over at most `reps` calls (fewer if `budget_s` runs out)."""
    return timeit_cpu(fn, reps, budget_s)[0]


def timeit_cpu(
    fn: Callable[[], object], reps: int, budget_s: float = 20.0
) -> tuple[float, float]:
    """Median (wall, process CPU) seconds per call.

    CPU time sums every thread of this process and leaves out time spent waiting for a core,
    so on a shared, oversubscribed machine it is the steadier measure of the work done.
    """
    fn()
    walls: list[float] = []
    cpus: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if time.perf_counter() > deadline:
            break
    return statistics.median(walls), statistics.median(cpus)


def copy_bandwidth() -> float:
    """Bytes moved (read + written) per second by the best of a NumPy and a torch 512 MiB copy."""
    n = 512 * 2**20
    src = np.ones(n, np.uint8)
    dst = np.empty_like(src)
    t_np = timeit(lambda: np.copyto(dst, src), reps=5)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    t_torch = timeit(lambda: tdst.copy_(tsrc), reps=5)
    return 2 * n / min(t_np, t_torch)


def _paged(rng: np.random.Generator, batch: int, ctx: int, dtype: str):
    """Full caches for `batch` sequences of `ctx` tokens, blocks shuffled across the pool."""
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    torch_dtype = getattr(torch, dtype)
    key_cache = torch.randn(shape, dtype=torch.float32).to(torch_dtype)
    value_cache = torch.randn(shape, dtype=torch.float32).to(torch_dtype)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    lens = np.full(batch, ctx, np.int32)
    return key_cache, value_cache, tables, lens


def _torch_gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, kv_heads, ctx, head_dim] contiguous copy of the paged cache."""
    batch, blocks = tables.shape
    gathered = cache[tables.reshape(-1)]  # [batch*blocks, kv_heads, block_size, head_dim]
    gathered = gathered.view(batch, blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return gathered.permute(0, 2, 1, 3, 4).reshape(batch, NUM_KV_HEADS, -1, HEAD_DIM)


def _gather_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   tables: torch.Tensor, scale: float) -> torch.Tensor:
    """torch SDPA including the gather of the paged K/V into contiguous tensors."""
    return _torch_decode(query, _torch_gather(key_cache, tables), _torch_gather(value_cache, tables),
                         scale)


def _torch_decode(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    # The GROUP query heads of one KV head become GROUP query rows of that head: exact GQA
    # decode and the fastest of the torch CPU formulations we tried (vs enable_gqa / repeat).
    batch = query.shape[0]
    q = query.view(batch, NUM_KV_HEADS, GROUP, HEAD_DIM)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def bench_decode(rng: np.random.Generator, bandwidth: float, quick: bool) -> None:
    print("\n## decode: 32 query / 8 KV heads, head_dim 128, block_size 16")
    print(f"{'kv':>8} {'B':>4} {'ctx':>5} {'kernel ms':>10} {'cpu ms':>8} {'KV GB/s':>8}"
          f" {'of copy bw':>10}"
          f" {'torch ms':>9} {'torch+gather ms':>16} {'vs torch':>9} {'split':>6}")
    batches = [1, 16] if quick else [1, 16, 64]
    for dtype in ("float16", "float32"):
        for batch in batches:
            for ctx in (512, 4096):
                key_cache, value_cache, tables, lens = _paged(rng, batch, ctx, dtype)
                query = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(getattr(torch, dtype))
                out = torch.empty_like(query)
                scale = HEAD_DIM**-0.5
                reps = 20 if batch * ctx <= 16 * 512 else 5
                t_kernel, cpu_kernel = timeit_cpu(partial(
                    kernels.paged_attention_decode, query, key_cache, value_cache, tables, lens,
                    scale, out=out), reps)
                tt = torch.from_numpy(tables).long()
                k, v = _torch_gather(key_cache, tt), _torch_gather(value_cache, tt)
                t_sdpa = timeit(partial(_torch_decode, query, k, v, scale), reps)
                t_gather = timeit(partial(_gather_decode, query, key_cache, value_cache, tt,
                                          scale), reps)
                del k, v
                kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
                split = cpu_decode.use_split(batch, NUM_KV_HEADS, ctx, BLOCK_SIZE)
                print(f"{dtype:>8} {batch:>4} {ctx:>5} {t_kernel * 1e3:>10.2f} "
                      f"{cpu_kernel * 1e3:>8.2f} "
                      f"{kv_bytes / t_kernel / 1e9:>8.2f} {kv_bytes / t_kernel / bandwidth:>10.2f} "
                      f"{t_sdpa * 1e3:>9.2f} {t_gather * 1e3:>16.2f} "
                      f"{t_sdpa / t_kernel:>8.2f}x {'yes' if split else 'no':>6}")
                del key_cache, value_cache


def bench_split(rng: np.random.Generator) -> None:
    """Single-pass vs split-K decode where (sequence, KV head) items are fewer than cores."""
    print("\n## split-K decode: 1 sequence, MQA (32 query heads, 1 KV head), fp16 KV")
    print(f"{'ctx':>6} {'single ms':>10} {'split ms':>9} {'speed-up':>9} {'rule picks':>11}")
    for ctx in (4096, 32768):
        blocks = ctx // BLOCK_SIZE
        shape = (blocks, 1, BLOCK_SIZE, HEAD_DIM)
        key_cache = rng.standard_normal(shape, np.float32).astype(np.float16)
        value_cache = rng.standard_normal(shape, np.float32).astype(np.float16)
        tables = rng.permutation(blocks).astype(np.int32)[None, :]
        lens = np.array([ctx], np.int32)
        query = rng.standard_normal((1, NUM_HEADS, HEAD_DIM), np.float32)
        times = {}
        for split in (False, True):
            times[split] = timeit(partial(cpu_decode.paged_attention_decode, query, key_cache,
                                          value_cache, tables, lens, 0.1, split=split), 20)
        picks = "split" if cpu_decode.use_split(1, 1, ctx, BLOCK_SIZE) else "single"
        print(f"{ctx:>6} {times[False] * 1e3:>10.2f} {times[True] * 1e3:>9.2f} "
              f"{times[False] / times[True]:>8.2f}x {picks:>11}")


def bench_prefill(rng: np.random.Generator) -> None:
    print("\n## prefill (causal over paged prefix + new tokens): 32/8 heads, head_dim 128, fp16 KV")
    print(f"{'shape':>28} {'kernel ms':>10} {'GFLOP/s':>8} {'torch sdpa ms':>14}")
    # (num_seqs, prefix tokens already cached, new query tokens per sequence)
    for num_seqs, prefix, q_len in ((1, 0, 512), (4, 0, 256), (2, 1024, 128)):
        ctx = prefix + q_len
        key_cache, value_cache, tables, lens = _paged(rng, num_seqs, ctx, "float16")
        starts = (np.arange(num_seqs + 1) * q_len).astype(np.int32)
        query = torch.randn(num_seqs * q_len, NUM_HEADS, HEAD_DIM).half()
        out = torch.empty_like(query)
        scale = HEAD_DIM**-0.5
        t_kernel = timeit(partial(kernels.paged_prefill_attention, query, key_cache, value_cache,
                                  tables, lens, starts, scale, out=out), 5)
        # Causal QK^T and PV: ~2 * 2 * head_dim FLOPs per visible (query, key) pair per head.
        pairs = num_seqs * sum(prefix + j + 1 for j in range(q_len))
        gflops = 4 * HEAD_DIM * NUM_HEADS * pairs / t_kernel / 1e9
        torch_ms = "n/a (prefix)"
        if prefix == 0:
            tt = torch.from_numpy(tables).long()
            k = _torch_gather(key_cache, tt).repeat_interleave(GROUP, 1)
            v = _torch_gather(value_cache, tt).repeat_interleave(GROUP, 1)
            q = query.view(num_seqs, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
            t_sdpa = timeit(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True), 5)
            torch_ms = f"{t_sdpa * 1e3:.2f}"
        shape = f"{num_seqs}x(prefix {prefix} + {q_len})"
        print(f"{shape:>28} {t_kernel * 1e3:>10.2f} {gflops:>8.1f} {torch_ms:>14}")


def bench_write_copy(rng: np.random.Generator, bandwidth: float) -> None:
    print("\n## write_slots / copy_blocks: 8 KV heads, head_dim 128, block_size 16, fp16")
    num_blocks = 4096
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    key_cache = np.zeros(shape, np.float16)
    value_cache = np.zeros(shape, np.float16)
    print(f"{'op':>34} {'ms':>8} {'GB/s moved':>11} {'of copy bw':>10}")
    for num_tokens in (64, 4096):
        key = rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(np.float16)
        slots = rng.permutation(num_blocks * BLOCK_SIZE)[:num_tokens].astype(np.int64)
        t = timeit(partial(kernels.write_slots, key, key, key_cache, value_cache, slots), 20)
        moved = 2 * 2 * key.nbytes  # K and V, read + written
        print(f"{f'write_slots {num_tokens} tokens':>34} {t * 1e3:>8.3f} {moved / t / 1e9:>11.2f}"
              f" {moved / t / bandwidth:>10.2f}")
    layers = [np.zeros((1024, *shape[1:]), np.float16) for _ in range(8)]
    for num_pairs in (16, 256):
        pairs = rng.permutation(1024)[: 2 * num_pairs].reshape(num_pairs, 2).astype(np.int64)
        t = timeit(partial(kernels.copy_blocks, layers[:4], layers[4:], pairs), 20)
        moved = 2 * 8 * num_pairs * layers[0][0].nbytes
        label = f"copy_blocks {num_pairs} pairs x 4 layers"
        print(f"{label:>34} {t * 1e3:>8.3f} {moved / t / 1e9:>11.2f} {moved / t / bandwidth:>10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the B=64 decode rows")
    args = parser.parse_args()
    torch.set_num_threads(numba.get_num_threads())
    rng = np.random.default_rng(0)
    print(f"# CPU kernels — {platform.machine()}, {numba.get_num_threads()} Numba threads, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at start")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (read+write, 512 MiB): {bandwidth / 1e9:.2f} GB/s")
    bench_decode(rng, bandwidth, args.quick)
    bench_split(rng)
    bench_prefill(rng)
    bench_write_copy(rng, bandwidth)
    print(f"\nNumba threading layer {numba.threading_layer()}; load average "
          f"{os.getloadavg()[0]:.1f} at end (other processes share these cores)")


if __name__ == "__main__":
    main()
