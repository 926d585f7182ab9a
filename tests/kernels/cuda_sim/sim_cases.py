"""Random paged-KV inputs for the simulator tests (tiny shapes: the simulator is slow).

Caches are filled with NaN everywhere except the slots that hold a sequence's tokens, and
block-table padding past each sequence's last block is garbage, so a kernel that reads a slot
or table entry it should not produces NaN or faults instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Queries are scaled up so logits have a spread of a few units: a near-uniform softmax would
# hide masking and max-tracking errors.
QUERY_SCALE = 3.0


@dataclass(slots=True)
class PagedCase:
    key_cache: np.ndarray  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: np.ndarray
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: np.ndarray  # int32 [num_seqs]
    scale: float


def make_case(
    rng: np.random.Generator, seq_lens: list[int], *, num_kv_heads: int, block_size: int,
    head_dim: int, dtype: type = np.float16, spare_blocks: int = 3, pad_blocks: int = 1,
) -> PagedCase:
    """Sequences of the given lengths in shuffled, non-contiguous blocks of one pool."""
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(used) + spare_blocks
    ids = rng.permutation(num_blocks)
    max_blocks = max(used) + pad_blocks
    tables = np.full((len(seq_lens), max_blocks), 10**6, dtype=np.int32)  # garbage padding
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = np.full(shape, np.nan, dtype=dtype)
    value_cache = np.full(shape, np.nan, dtype=dtype)
    cursor = 0
    for s, (n, nb) in enumerate(zip(seq_lens, used)):
        tables[s, :nb] = ids[cursor:cursor + nb]
        cursor += nb
        for pos in range(n):
            block, off = tables[s, pos // block_size], pos % block_size
            key_cache[block, :, off] = rng.standard_normal((num_kv_heads, head_dim))
            value_cache[block, :, off] = rng.standard_normal((num_kv_heads, head_dim))
    return PagedCase(key_cache, value_cache, tables, np.asarray(seq_lens, dtype=np.int32),
                     1.0 / np.sqrt(head_dim))


def queries(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return (rng.standard_normal(shape) * QUERY_SCALE).astype(dtype)


def assert_close(out: np.ndarray, ref: np.ndarray, rel: float) -> None:
    """Every row (token, head) within `rel` of its reference norm; no NaN anywhere.

    Row-wise rather than global so one wrong head cannot hide behind many right ones.
    """
    got = np.asarray(out, dtype=np.float64)
    assert not np.isnan(got).any(), "output has NaN (unwritten element or NaN read)"
    err = np.linalg.norm(got - ref, axis=-1)
    norm = np.linalg.norm(ref, axis=-1)
    worst = float((err / norm).max())
    assert worst <= rel, f"relative error {worst:.2e} > {rel:.0e}"


def record_split_parts(monkeypatch) -> list[list[int]]:
    """Patch the split-K launch to record each call's partitions per sequence (then launch as
    before): the list the policy tests compare with what the policy should pick."""
    from kernels.cuda import decode_split  # only under the simulator, as the tests importing this

    calls: list[list[int]] = []
    real = decode_split.paged_attention_decode_split

    def spy(*args, **kwargs):
        calls.append(kwargs["parts"].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_split, "paged_attention_decode_split", spy)
    return calls
