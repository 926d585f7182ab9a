"""Which decode kernel runs, and how each sequence's context is cut into split-K partitions.

Pure host arithmetic (no Numba, no device): `decode.py`, `plan.py` and `graph.py` call it with
the resident-block counts of the kernels they would launch (`Occupancy`).

Why each rule (issue 43, review `kernels.md` §1.2):
- **Each kernel's own occupancy.** The one-pass kernel keeps 6 blocks per SM on sm_90 (80
  registers), the split-K kernel 5 (93-95 registers). Sizing split grids against the one-pass
  figure (792 on 132 SMs) put most of them at 768-784 blocks: 1.16-1.19 waves of the 660 the
  split kernel really holds, a tail wave of one block per SM. Every candidate below is judged
  against the slots of the kernel it would launch.
- **Wave efficiency (FlashAttention-2/3's rule).** A grid of W blocks on R resident slots runs
  ceil(W / R) waves; the time of a wave is its longest block. For each candidate partitioning,
  efficiency = useful block-tokens / (R x waves x tokens of the longest block); for a uniform
  batch this is FA2's `n_waves / ceil(n_waves)`. The partitioning with the fewest partitions
  whose efficiency is within `NEAR_BEST` of the best wins: each extra partition costs a
  partial write and a longer reduce, so near-ties go to fewer.
- **A common chunk size for every sequence (FlashInfer's rule).** Partitioning by a common
  *count* gives a 32K sequence 32x longer partitions than its 1K neighbours, and it alone sets
  the time. Here the candidates are chunk sizes: a sequence of n tokens gets ceil(n / chunk)
  partitions, so the longest gets the most and every block carries at most one chunk.
- **No split below `MIN_SPLIT_TOKENS`.** A sequence that short is a few microseconds of
  K/V; a second kernel and a merge cost more than they save (FA3 never splits 512 keys at
  d128). A batch whose longest sequence is that short runs one pass.
- **One pass once it keeps half the GPU busy.** Decode is memory-bound: when the one-pass
  grid's efficiency is >= `ONE_PASS_FILL` (a uniform batch filling half of the one-pass slots,
  3 blocks per SM) it streams near copy bandwidth (0.85-0.91 of copy measured at B=64 on an
  H200), and more waves would only add the merge. A ragged batch whose longest sequence
  dominates has a low one-pass efficiency whatever its size, so it is split.

Graph buckets run a fixed split grid (`graph_items`), so `max_items` bounds the candidates;
lengths known only on the device are taken at the table capacity (`uniform_parts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_PARTS = 64  # partitions per sequence: the reduce kernel holds two per lane
PART_ALIGN = 64  # partition sizes are whole 16-token steps of each of the 4 warps
MIN_PART_TOKENS = 256  # a partition's K/V outweighs its partial write and reduce read
MIN_SPLIT_TOKENS = 1024  # shorter sequences are never split
NEAR_BEST = 0.85  # FA2/FA3: the fewest partitions within 85% of the best efficiency
ONE_PASS_FILL = 0.5  # one pass when its grid fills this much of the one-pass slots
MAX_WAVES = 4  # candidates beyond 4 waves of the split kernel are not considered (below)


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Thread blocks the whole GPU keeps resident, per decode kernel of one variant (blocks
    per SM from the compiled kernel's registers and shared memory, times the SMs)."""

    one_pass: int
    split: int


def wave_efficiency(blocks: int, resident: int) -> float:
    """FA2's n_waves / ceil(n_waves): the share of the slots busy over the grid's waves."""
    if blocks <= 0:
        return 0.0
    waves = blocks / resident
    return waves / math.ceil(waves)


def part_tokens(seq_len: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """Tokens per partition as the split kernel cuts them (`decode_reduce.part_tokens`)."""
    per = -(-seq_len // np.maximum(parts, 1))
    return -(-per // PART_ALIGN) * PART_ALIGN


def _chunk_candidates(max_len: int) -> np.ndarray:
    """Distinct chunk sizes (tokens), largest first: 2..MAX_PARTS parts of the longest
    sequence, rounded up to PART_ALIGN, at least MIN_PART_TOKENS."""
    per = -(-max_len // np.arange(2, MAX_PARTS + 1))
    chunks = np.maximum(MIN_PART_TOKENS, -(-per // PART_ALIGN) * PART_ALIGN)
    return np.unique(chunks)[::-1]


def parts_for_chunk(lens: np.ndarray, chunk: np.ndarray | int) -> np.ndarray:
    """Partitions per sequence for a common chunk: ceil(len / chunk), one for a sequence
    shorter than MIN_SPLIT_TOKENS, none for an empty one (a graph bucket's padded row).
    `chunk` may be a column of candidates: one row of partitions per candidate."""
    parts = np.where(lens < MIN_SPLIT_TOKENS, 1, -(-lens // chunk))
    return np.where(lens > 0, parts, 0).astype(np.int32)


def _efficiency(lens: np.ndarray, parts: np.ndarray, heads_grid: int,
                resident: int) -> np.ndarray:
    """Per row of `parts`: useful block-tokens / (slots x waves x the longest block's
    tokens). For a uniform batch, FA2's n_waves / ceil(n_waves) (up to the alignment)."""
    blocks = parts.sum(axis=-1) * heads_grid
    longest = np.minimum(lens, part_tokens(lens, parts)).max(axis=-1)
    waves = -(-blocks // resident)
    return float(lens.sum()) * heads_grid / (resident * np.maximum(waves * longest, 1))


def split_parts(seq_lens: np.ndarray, heads_grid: int, occupancy: Occupancy,
                max_items: int | None = None) -> np.ndarray | None:
    """Partitions per sequence (int32 [num_seqs]) for the split-K kernel, or None for one
    pass (module docstring). `heads_grid`: thread blocks per partition (KV heads x row
    blocks). `max_items`: the most (sequence, partition) work items the caller's buffers
    hold (a graph bucket's); partitionings with more are not considered."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.size == 0 or int(lens.max()) < MIN_SPLIT_TOKENS:
        return None
    one_pass = float(_efficiency(lens, np.where(lens > 0, 1, 0), heads_grid,
                                 occupancy.one_pass))
    if one_pass >= ONE_PASS_FILL:
        return None
    chunks = _chunk_candidates(int(lens.max()))
    # A chunk so small that the grid passes MAX_WAVES waves of the split kernel never wins:
    # efficiency is within ~1/waves of 1 from two waves on, so a larger chunk already came
    # within NEAR_BEST. Dropping them by a lower bound on the items (no rounding up) keeps
    # the host cost per step small.
    smallest = float(lens.sum()) * heads_grid / (MAX_WAVES * occupancy.split)
    chunks = chunks[chunks >= smallest]
    if chunks.size == 0:
        return None
    parts = parts_for_chunk(lens[None, :], chunks[:, None])  # [candidates, num_seqs]
    split = parts.max(axis=1) > 1  # not split at all: the one-pass kernel does it better
    if max_items is not None:
        split &= parts.sum(axis=1) <= max_items
    if not split.any():
        return None
    parts = parts[split]
    eff = _efficiency(lens[None, :], parts, heads_grid, occupancy.split)
    best = max(one_pass, float(eff.max()))
    if one_pass >= NEAR_BEST * best:
        return None
    return parts[int(np.argmax(eff >= NEAR_BEST * best))]  # the largest chunk near the best


def uniform_parts(num_seqs: int, max_len: int, heads_grid: int, occupancy: Occupancy,
                  max_items: int | None = None) -> int:
    """Partitions per sequence when the lengths are unknown on the host (device-resident, or
    a graph bucket's design point): the policy for `num_seqs` sequences of `max_len`."""
    parts = split_parts(np.full(num_seqs, max_len), heads_grid, occupancy, max_items)
    return 1 if parts is None else int(parts[0])


def graph_items(batch: int, capacity: int, heads_grid: int, occupancy: Occupancy) -> int:
    """Work items a graph bucket's split plan must hold: its design point (every row at the
    table capacity) or the padded batch plus one more wave of the split kernel, whichever is
    larger — so a ragged step can give its long sequences a wave of partitions — and never
    more than MAX_PARTS per row."""
    design = batch * uniform_parts(batch, capacity, heads_grid, occupancy)
    extra = batch + -(-occupancy.split // heads_grid)
    return min(batch * MAX_PARTS, max(design, extra))


def work_items(parts: np.ndarray, max_items: int | None = None) -> np.ndarray:
    """The device work list for `parts` partitions per sequence, one int32 array:
    [sequence of each item (-1 past the end, up to max_items) | first item of each sequence,
    and the total]. The split kernel finds its (sequence, partition) from the first part,
    the reduce each sequence's partials from the second."""
    parts = np.asarray(parts, dtype=np.int32)
    total = int(parts.sum())
    size = total if max_items is None else max_items
    if total > size:
        raise ValueError(f"{total} work items exceed the plan's {size}")
    seq_of = np.full(size, -1, np.int32)
    seq_of[:total] = np.repeat(np.arange(parts.size, dtype=np.int32), parts)
    first = np.zeros(parts.size + 1, np.int32)
    np.cumsum(parts, out=first[1:])
    return np.concatenate([seq_of, first])
