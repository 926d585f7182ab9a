"""CPU decode at a million tokens: bytes of K/V read per second (issue 22).

One sequence of 1,000,000 tokens in 62,500 shuffled blocks of 16 (1 KV head, head dim 64,
fp16: 256 MB of K/V), GQA 4; decode of its next token, single-pass and split-K, median of a
few calls after a warm-up (Numba compile / cache load), next to this machine's copy bandwidth
(read + write bytes of a 512 MiB copy). Bounded: ~1 minute on 2 cores.

    .venv/bin/python bench/bench_million.py [--reps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from million_case import GROUP, HEAD_DIM, MILLION, NUM_BLOCKS, make_million_case  # noqa: E402

from kernels.cpu import decode as cpu_decode  # noqa: E402


def median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = np.ones(512 << 20, np.uint8)
    dst = np.empty_like(src)
    return 2 * src.nbytes / median_s(lambda: np.copyto(dst, src), 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    print(f"# CPU decode at {MILLION:,} tokens ({NUM_BLOCKS:,} blocks of 16), 1 KV head x "
          f"{GROUP} query heads, d{HEAD_DIM}, fp16; {numba.get_num_threads()} Numba threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    case = make_million_case()
    print(f"built {case.kv_bytes / 1e6:.0f} MB of K/V in {time.perf_counter() - t0:.1f} s")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (read+write, 512 MiB): {bandwidth / 1e9:.2f} GB/s")
    query = np.random.default_rng(1).standard_normal((1, GROUP, HEAD_DIM), np.float32)
    lens = np.array([MILLION], np.int32)
    print("| kernel | ms | K/V GB/s | ÷ copy bandwidth |")
    print("|---|---|---|---|")
    for split in (False, True):
        s = median_s(lambda split=split: cpu_decode.paged_attention_decode(
            query, case.key_cache, case.value_cache, case.table[None, :], lens, case.scale,
            split=split), args.reps)
        gbs = case.kv_bytes / s / 1e9
        print(f"| {'split-K' if split else 'single-pass'} | {s * 1e3:.1f} | {gbs:.2f} | "
              f"{gbs * 1e9 / bandwidth:.2f} |")
    print(f"load average {os.getloadavg()[0]:.1f} at end (the cores are shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
