"""The sizes of every GPU-check cell: the real run's, and the --cpu-smoke run's tiny ones.

One frozen table, so the smoke run walks exactly the cells the GPU run will (same code, same
order) with sizes a CPU and Numba's simulator get through in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Sizes:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    # decode grid (review §4.3 item 2): B x context, B=256 capped at b256_max_ctx
    batches: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (512, 4096, 32768)
    b256_max_ctx: int = 8192
    # split A/B (item 3) and the shortest context worth splitting (item 4)
    split_cells: tuple[tuple[int, int], ...] = ((16, 32768), (32, 32768), (16, 4096))
    split_parts: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 12)
    min_split_cells: tuple[tuple[int, int], ...] = ((1, 512), (1, 1024), (1, 2048),
                                                    (16, 512), (16, 1024), (16, 2048))
    # paging cost (item 5), block sizes (item 6), bf16 / d64 (item 7)
    long_cell: tuple[int, int] = (64, 32768)
    block_sizes: tuple[int, ...] = (8, 16, 32, 64)
    block_cells: tuple[tuple[int, int], ...] = ((64, 4096), (64, 32768))
    # ragged batch (item 8): log-uniform lengths plus one long sequence
    ragged_num: int = 64
    ragged_range: tuple[int, int] = (256, 32768)
    ragged_long: int = 131072
    # a million tokens (item 9)
    million: int = 1 << 20
    million_chunk: int = 512
    # prefill (items 10-11)
    prefill_tokens: int = 8192
    prefix_lens: tuple[int, ...] = (8192, 32768)
    prefix_q_lens: tuple[int, ...] = (16, 64, 512)
    prefix_batches: tuple[int, ...] = (1, 16)
    # timing
    max_reps: int = 30
    l2_sets_factor: int = 4  # rotate over disjoint K/V copies totalling this x L2
    # correctness (existing matrix) at full size
    smoke: bool = False


FULL = Sizes()

SMOKE = replace(
    FULL, batches=(1, 4), contexts=(64, 256), b256_max_ctx=64,
    split_cells=((2, 256),), split_parts=(1, 2), min_split_cells=((1, 64),),
    long_cell=(4, 256), block_sizes=(8, 16), block_cells=((2, 128),),
    ragged_num=3, ragged_range=(16, 128), ragged_long=512,
    million=2048, million_chunk=32, prefill_tokens=32, prefix_lens=(128,), prefix_q_lens=(16,),
    prefix_batches=(1,), max_reps=2, l2_sets_factor=1, smoke=True)


def decode_grid(sizes: Sizes) -> list[tuple[int, int]]:
    """(batch, context) cells of the decode grid: B=256 only up to `b256_max_ctx` (its
    32768-token cell needs 34 GB of paged K/V plus as much again for SDPA)."""
    cells = []
    for batch in sizes.batches:
        for ctx in sizes.contexts:
            if batch >= 256 and ctx > sizes.b256_max_ctx:
                ctx = sizes.b256_max_ctx
                if (batch, ctx) in cells:
                    continue
            cells.append((batch, ctx))
    return cells


def ragged_lengths(sizes: Sizes, seed: int = 8) -> list[int]:
    """`ragged_num` lengths log-uniform in `ragged_range`, plus one of `ragged_long`."""
    import math
    import random

    rng = random.Random(seed)
    lo, hi = sizes.ragged_range
    lens = [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
            for _ in range(sizes.ragged_num)]
    return lens + [sizes.ragged_long]
