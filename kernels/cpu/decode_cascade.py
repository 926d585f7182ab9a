"""CPU decode attention over a shared prefix, for float32 caches: each shared prefix block is
read once for every decode sequence that shares it, and the prefix part runs through the AVX2
register tiles of the flash prefill kernel (`prefill_flash.attend_keys`).

Why: with prefix caching, sequences that began with the same prompt prefix point at the same
physical blocks (the shared-prefix workload: 24 sequences of ~300 tokens, 256 of them shared).
The per-sequence decode kernel (`attend.decode_item`) reads those blocks once per sequence and
scores one token's GQA group at a time, a matrix-vector product whose dot products end in
horizontal sums. Stacking the query rows of every sharing sequence (sequences x group) turns
the prefix part into one matrix product per KV head, the shape the FMA tiles are built for.

Work item = (chunk of sharing sequences, KV head): the chunk's query rows (up to about
`CHUNK_ROWS`) attend the shared prefix blocks through the tiles, then each sequence continues
the same online softmax (running max, sum and accumulator) over its own blocks with the decode
kernel's `_tile.attend_blocks`, and is normalised and stored. A sequence that shares nothing
is a chunk of one with no prefix: the decode kernel alone, as before. Chunks keep the items
numerous enough for the threads (one prefix of 24 sequences and 3 KV heads would be 3 items).

Measured (`bench/bench_cpu_attention.py --one-thread`, per layer, CPU ms, loaded host,
2026-12-08 00:07): 24 decode sequences of ~300 tokens sharing 256, per-sequence items 2.08 vs
cascade 1.15 at the 135M shape (9 / 3 heads), 1.84 vs 1.10 at Qwen2.5-0.5B's (14 / 2); with
nothing shared the plan is None and the per-sequence items stay.

Groups are found from the block tables alone (`cascade_plan`): sequences with the same first
block, and the leading blocks all of them share. Only whole blocks strictly before each
member's last token count, so every member has at least one key of its own.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from kernels.cpu._cache import njit_cached
from kernels.cpu._host import KIND_F32
from kernels.cpu._tile import attend_blocks
from kernels.cpu.prefill_flash import attend_keys, scaled_group

CHUNK_ROWS = 48   # query rows (sequences x group) per item: the prefix tile is read once for them


def cascade_plan(tables: np.ndarray, seq_lens: np.ndarray, block_size: int, group: int,
                 num_kv_heads: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(sequence order int32 [num_seqs], items int32 [items, 4]: first index into the order,
    sequence count, shared prefix blocks, KV head), heaviest items first; None when no two
    sequences share a whole block (nothing for the cascade to save)."""
    num_seqs = len(seq_lens)
    lens = seq_lens.astype(np.int64)
    groups: dict[int, list[int]] = {}
    for s in range(num_seqs):
        if lens[s] > block_size:          # has a whole block before its last token
            groups.setdefault(int(tables[s, 0]), []).append(s)
    chunks: list[tuple[list[int], int]] = []   # (sequences, shared blocks)
    shared_any = False
    grouped: set[int] = set()
    per_chunk = max(1, CHUNK_ROWS // group)
    for members in groups.values():
        if len(members) < 2:
            continue
        limit = int(((lens[members] - 1) // block_size).min())
        rows = tables[members, :limit]
        same = (rows == rows[0]).all(axis=0)
        prefix = int(limit if same.all() else np.argmin(same))
        if prefix == 0:
            continue
        shared_any = True
        grouped.update(members)
        for i in range(0, len(members), per_chunk):
            chunks.append((members[i:i + per_chunk], prefix))
    if not shared_any:
        return None
    chunks.extend(([s], 0) for s in range(num_seqs) if s not in grouped)
    order: list[int] = []
    items: list[tuple[int, int, int, int, int]] = []
    for seqs, prefix in chunks:
        work = prefix * block_size * len(seqs) // 4 + int(sum(lens[s] - prefix * block_size for s in seqs))
        for h in range(num_kv_heads):
            items.append((work, len(order), len(seqs), prefix, h))
        order.extend(seqs)
    items.sort(key=lambda item: -item[0])
    return np.array(order, np.int32), np.array([item[1:] for item in items], np.int32).reshape(-1, 4)


@njit_cached()
def cascade_item(query, key_cache, value_cache, key_bits, value_bits, block_tables, seq_lens, order, first,
                 count, prefix_blocks, kv_head, scale, out):
    """Decode rows of sequences `order[first : first + count]` (sequence s on row s), the GQA
    group of `kv_head`: the shared `prefix_blocks` through the tiles for all of them at once,
    then each one's own blocks; `key_cache`/`value_cache` float32, `*_bits` their uint16 views."""
    head_dim = query.shape[2]
    group = query.shape[1] // key_cache.shape[1]
    block_size = key_cache.shape[2]
    rows = count * group
    qs = np.empty((rows, head_dim), np.float32)
    for i in range(count):
        scaled_group(query, order[first + i], kv_head, group, scale, qs, i * group)
    o = np.zeros((rows, head_dim), np.float32)
    m = np.full(rows, -np.inf, np.float32)
    l = np.zeros(rows, np.float32)
    prefix_keys = prefix_blocks * block_size
    if prefix_keys > 0:
        attend_keys(qs, key_cache, value_cache, block_tables[order[first]], kv_head, prefix_keys, prefix_keys,
                    group, o, m, l)
    for i in range(count):
        s = order[first + i]
        seq_len = seq_lens[s]
        r0, r1 = i * group, (i + 1) * group
        attend_blocks(qs[r0:r1], key_bits, value_bits, KIND_F32, block_tables[s], seq_len, kv_head,
                      prefix_blocks, (seq_len + block_size - 1) // block_size, m[r0:r1], l[r0:r1], o[r0:r1])
        for g in range(group):
            inv = np.float32(1.0) / l[r0 + g]
            src = o[r0 + g]
            dst = out[s, kv_head * group + g]
            for d in range(head_dim):
                dst[d] = src[d] * inv


@njit_cached(parallel=True)
def _cascade_parallel(query, key_cache, value_cache, key_bits, value_bits, block_tables, seq_lens, order, items,
                      scale, out):
    for i in prange(items.shape[0]):
        cascade_item(query, key_cache, value_cache, key_bits, value_bits, block_tables, seq_lens, order,
                     items[i, 0], items[i, 1], items[i, 2], items[i, 3], scale, out)


@njit_cached()
def _cascade_serial(query, key_cache, value_cache, key_bits, value_bits, block_tables, seq_lens, order, items,
                    scale, out):
    for i in range(items.shape[0]):
        cascade_item(query, key_cache, value_cache, key_bits, value_bits, block_tables, seq_lens, order,
                     items[i, 0], items[i, 1], items[i, 2], items[i, 3], scale, out)


def cascade_decode(serial: bool, query: np.ndarray, key_bits: np.ndarray, value_bits: np.ndarray,
                   block_tables: np.ndarray, seq_lens: np.ndarray, plan: tuple[np.ndarray, np.ndarray],
                   scale: np.float32, out: np.ndarray) -> None:
    """Attend every decode row of a `cascade_plan` (validated arrays: float32 query/out whose
    first rows are the decode sequences, the caches' uint16 views of float32 caches, int32
    tables and lengths). The caller sets the threads (`_parallel.parallel_section`)."""
    order, items = plan
    run = _cascade_serial if serial else _cascade_parallel
    run(query, key_bits.view(np.float32), value_bits.view(np.float32), key_bits, value_bits, block_tables, seq_lens,
        order, items, scale, out)
