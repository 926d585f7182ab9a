"""Random paged-attention inputs shared by the kernel tests (NumPy, or torch for bfloat16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import reference


@dataclass(slots=True)
class PagedCase:
    query: Any  # decode [num_seqs, num_heads, head_dim]; prefill [total_tokens, ...]
    key_cache: Any  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: Any
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_per_seq], -1 padding
    seq_lens: np.ndarray  # int32 [num_seqs]
    scale: float
    query_start_loc: np.ndarray | None = None  # int32 [num_seqs + 1], prefill only


def random_kv(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> Any:
    """Standard-normal values in `dtype`; bfloat16 as a torch tensor (NumPy has no bf16)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        return torch.from_numpy(values).to(torch.bfloat16)
    return values.astype(dtype)


def shuffled_tables(
    rng: np.random.Generator, seq_lens: list[int], block_size: int, num_blocks: int
) -> np.ndarray:
    """Disjoint, shuffled (non-contiguous) block ids per sequence, rows padded with -1."""
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError("pool too small for the requested sequences")
    ids = rng.permutation(num_blocks)
    tables = np.full((len(seq_lens), max(needed) + 1), -1, np.int32)
    at = 0
    for s, n in enumerate(needed):
        tables[s, :n] = ids[at : at + n]
        at += n
    return tables


def make_case(
    rng: np.random.Generator,
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 128,
    block_size: int = 16,
    kv_dtype: str = "float16",
    query_dtype: str = "float32",
    query_lens: list[int] | None = None,
    spare_blocks: int = 7,
) -> PagedCase:
    """A decode case, or a prefill case when `query_lens` is given.

    Queries are scaled so logits have a standard deviation of about 4: softmax is then far
    from uniform, so a wrong mask, block order or max-rescaling shows up in the output.
    """
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare_blocks
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = random_kv(rng, shape, kv_dtype)
    value_cache = random_kv(rng, shape, kv_dtype)
    num_tokens = len(seq_lens) if query_lens is None else sum(query_lens)
    q = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32) * 4.0
    query: Any = q.astype(query_dtype) if query_dtype != "bfloat16" else (
        torch.from_numpy(q).to(torch.bfloat16)
    )
    starts = None
    if query_lens is not None:
        starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return PagedCase(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=shuffled_tables(rng, seq_lens, block_size, num_blocks),
        seq_lens=np.array(seq_lens, np.int32),
        scale=1.0 / float(np.sqrt(head_dim)),
        query_start_loc=starts,
    )


def expected_decode(case: PagedCase) -> np.ndarray:
    return reference.paged_attention_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.scale,
    )


def expected_prefill(case: PagedCase) -> np.ndarray:
    return reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale,
    )


def as_f64(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_close_rel(actual: Any, expected: np.ndarray, rel: float) -> None:
    """Per (token, head): ||actual - expected||₂ ≤ rel · ||expected||₂, and no NaN anywhere."""
    got = as_f64(actual)
    if not np.isfinite(got).all():
        raise AssertionError(f"{int((~np.isfinite(got)).sum())} non-finite output elements")
    err = np.linalg.norm(got - expected, axis=-1)
    norm = np.linalg.norm(expected, axis=-1)
    worst = float((err / norm).max())
    if worst > rel:
        raise AssertionError(f"relative error {worst:.3e} > {rel:.1e}")
