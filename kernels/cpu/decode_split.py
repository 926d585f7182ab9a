"""CPU split-K decode attention: partitions of a long context in parallel, then a reduce.

For few sequences × long contexts (e.g. one sequence with an MQA cache) there are fewer
(sequence, KV head) work items than cores. Each work item here is (sequence, KV head,
partition of `PARTITION_TOKENS` tokens); it leaves an unnormalised partial result (running max,
running sum, accumulator), and `_reduce_kernel` merges the partials of each head with the usual
log-sum-exp rescaling. Same arithmetic as `decode.py`, so results agree to float32 rounding.
The partition items (`partition_item`) run in `attend.py`'s loop, next to a step's prefill
items: a split step is two parallel regions (the loop, the reduce), and the loop's machine code
is compiled once for all kinds of item.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import prange

from kernels.cpu._cache import njit_cached
from kernels.cpu._tile import FASTMATH, attend_blocks

# 512 tokens: long enough that per-partition overhead (scratch, reduce) is noise, short enough
# that a 4k context yields 8 partitions to spread over the cores.
PARTITION_TOKENS = 512


def num_partitions(max_seq_len: int, block_size: int) -> int:
    blocks_per_partition = max(1, PARTITION_TOKENS // block_size)
    num_blocks = -(-max_seq_len // block_size)
    return -(-num_blocks // blocks_per_partition)


@njit_cached(fastmath=FASTMATH)
def partition_item(item, query, key_cache, value_cache, kv_kind, block_tables, seq_lens, scale,
                   blocks_per_partition, part_m, part_l, part_acc):
    """Work item `item` of the partitions: (sequence, KV head, partition), in that nesting.

    query: [num_seqs, num_heads, head_dim] float32 (sequence s on row s);
    part_m/part_l: [num_split_seqs, num_heads, num_parts]; part_acc: [..., num_parts, head_dim].
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    num_parts = part_m.shape[2]
    group = num_heads // num_kv_heads
    part = item % num_parts
    kv_head = (item // num_parts) % num_kv_heads
    s = item // (num_parts * num_kv_heads)
    h0 = kv_head * group
    seq_len = seq_lens[s]
    num_blocks = (seq_len + block_size - 1) // block_size
    first = part * blocks_per_partition
    end = min(first + blocks_per_partition, num_blocks)
    m = np.full(group, -np.inf, np.float32)
    l = np.zeros(group, np.float32)
    acc = np.zeros((group, head_dim), np.float32)
    if first < end:
        q_group = np.empty((group, head_dim), np.float32)
        for g in range(group):
            for d in range(head_dim):
                q_group[g, d] = query[s, h0 + g, d] * scale
        attend_blocks(q_group, key_cache, value_cache, kv_kind, block_tables[s], seq_len,
                      kv_head, first, end, m, l, acc)
    # Empty partitions (past a short sequence's end) keep m=-inf, l=0: weight 0 in reduce.
    for g in range(group):
        part_m[s, h0 + g, part] = m[g]
        part_l[s, h0 + g, part] = l[g]
        for d in range(head_dim):
            part_acc[s, h0 + g, part, d] = acc[g, d]


@njit_cached(parallel=True, fastmath=FASTMATH)
def _reduce_kernel(part_m, part_l, part_acc, out):
    # out: [num_seqs, num_heads, head_dim] float32
    num_seqs, num_heads, num_parts = part_m.shape
    head_dim = out.shape[2]
    for item in prange(num_seqs * num_heads):
        s = item // num_heads
        h = item % num_heads
        m_max = part_m[s, h, 0]  # partition 0 is never empty: seq_len >= 1
        for p in range(1, num_parts):
            m_max = max(m_max, part_m[s, h, p])
        total = np.float32(0.0)
        for d in range(head_dim):
            out[s, h, d] = 0.0
        for p in range(num_parts):
            if part_l[s, h, p] == 0.0:
                continue
            w = np.float32(np.exp(part_m[s, h, p] - m_max))
            total += w * part_l[s, h, p]
            for d in range(head_dim):
                out[s, h, d] += w * part_acc[s, h, p, d]
        inv = np.float32(1.0) / total
        for d in range(head_dim):
            out[s, h, d] *= inv


@dataclass(slots=True, frozen=True)
class Partials:
    """The split-K partials of `num_seqs` sequences (the first rows of the query), filled in
    full by the partition items of `attend.py`'s loop and merged by `reduce`. A step reuses one
    for all its layers: every call overwrites every entry."""

    blocks_per_partition: int
    part_m: np.ndarray  # [num_seqs, num_heads, num_parts] float32
    part_l: np.ndarray  # [num_seqs, num_heads, num_parts] float32
    part_acc: np.ndarray  # [num_seqs, num_heads, num_parts, head_dim] float32

    @classmethod
    def new(cls, num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int, block_size: int) -> Partials:
        num_parts = num_partitions(max_seq_len, block_size)
        return cls(max(1, PARTITION_TOKENS // block_size),
                   np.empty((num_seqs, num_heads, num_parts), np.float32),
                   np.empty((num_seqs, num_heads, num_parts), np.float32),
                   np.empty((num_seqs, num_heads, num_parts, head_dim), np.float32))

    def args(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """What `attend.py`'s loop takes for them."""
        return self.blocks_per_partition, self.part_m, self.part_l, self.part_acc

    def reduce(self, out: np.ndarray) -> None:
        """Merge into `out` [num_seqs, num_heads, head_dim] float32 (written in full)."""
        _reduce_kernel(self.part_m, self.part_l, self.part_acc, out)


# No sequence split (what the loop takes then: one compiled signature for every caller).
NO_PARTIALS = Partials(1, np.zeros((0, 1, 1), np.float32), np.zeros((0, 1, 1), np.float32),
                       np.zeros((0, 1, 1, 1), np.float32))
