"""The AVX2 register-tile prefill kernel (`kernels.cpu.prefill_flash`) and its vector softmax
step (`kernels.cpu._softmax_tile`) against float64 references on random inputs.

Cases are ragged on purpose: whole prompts (square causal), chunks after a cached prefix
(bottom-right causal, the prefix entirely visible), one-token chunks, partial last blocks,
contexts long enough for several query items per sequence, shuffled block tables, MHA, GQA
(groups 3 and 7: the two model shapes) and MQA, block sizes 16 and 32, head dims 64 and 128,
serial and parallel drivers, and logits spread wide enough that the running max moves.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from numba import njit
from paged_cases import assert_close_rel, shuffled_tables

from kernels import reference
from kernels.cpu import _parallel, prefill_flash
from kernels.cpu._softmax_tile import softmax_row16

SEQS = [(1, 1), (16, 16), (17, 17), (40, 17), (296, 40), (300, 300), (700, 5), (129, 128)]   # (seq_len, q_len)


def _case(seed: str, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int, spread: float) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    lens = [n for n, _ in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    tables = shuffled_tables(rng, lens, block_size, num_blocks)
    kc = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim), dtype=np.float32)
    vc = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim), dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum([q for _, q in seqs])]).astype(np.int32)
    query = rng.standard_normal((int(starts[-1]), num_heads, head_dim), dtype=np.float32) * spread
    return query, kc, vc, tables.astype(np.int32), np.array(lens, np.int32), starts


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (14, 2, 64, 16), (4, 4, 128, 32), (8, 1, 64, 16)],
                         ids=["smollm", "qwen", "mha-d128-b32", "mqa"])
def test_matches_float64_reference(serial: bool, num_heads: int, num_kv_heads: int, head_dim: int,
                                   block_size: int) -> None:
    query, kc, vc, tables, lens, starts = _case(f"{serial}{num_heads}{head_dim}", SEQS, num_heads, num_kv_heads,
                                                head_dim, block_size, spread=3.0)
    scale = np.float32(head_dim ** -0.5)
    items = prefill_flash.flash_items(starts, lens, num_kv_heads, num_heads // num_kv_heads)
    out = np.full(query.shape, np.nan, np.float32)
    with _parallel.parallel_section(serial):
        prefill_flash.flash_prefill(serial, query, kc, vc, tables, lens, starts, items, scale, out)
    want = reference.paged_prefill_attention(query.astype(np.float64), kc, vc, tables, lens, starts, float(scale))
    assert_close_rel(out, np.asarray(want), 1e-4)


def test_items_cover_every_row_once_heaviest_first() -> None:
    """Each (query row, KV head) is in exactly one item, no item is longer than
    `query_tokens(group)`, and items are ordered by the last position they attend from."""
    lens = np.array([5, 300, 40], np.int32)
    starts = np.array([0, 5, 305, 322], np.int32)   # 5 whole, 300 whole, 17 after 23 cached
    for group in (1, 3, 7):
        items = prefill_flash.flash_items(starts, lens, 2, group)
        seen = np.zeros((322, 2), np.int64)
        for s, row, n, h in items:
            assert 1 <= n <= prefill_flash.query_tokens(group)
            assert starts[s] <= row and row + n <= starts[s + 1]
            seen[row:row + n, h] += 1
        assert (seen == 1).all()
        last = [int(lens[s] - (starts[s + 1] - row - n)) for s, row, n, _ in items]
        assert last == sorted(last, reverse=True)


def test_wide_logits_and_one_token_context() -> None:
    """Logits spread ~60 (the running max moves by far more than exp's range between tiles)
    and the smallest contexts stay finite and correct."""
    query, kc, vc, tables, lens, starts = _case("wide", [(1, 1), (2, 2), (200, 200), (90, 3)], 6, 2, 64, 16,
                                                spread=60.0)
    items = prefill_flash.flash_items(starts, lens, 2, 3)
    out = np.empty_like(query)
    prefill_flash.flash_prefill(True, query, kc, vc, tables, lens, starts, items, np.float32(0.125), out)
    want = reference.paged_prefill_attention(query.astype(np.float64), kc, vc, tables, lens, starts, 0.125)
    assert_close_rel(out, np.asarray(want), 1e-4)


def test_usable_shapes() -> None:
    assert prefill_flash.usable(64, 16) and prefill_flash.usable(128, 32)
    assert not prefill_flash.usable(72, 16) and not prefill_flash.usable(64, 8)


@njit
def _softmax_rows(scores: np.ndarray, m: np.ndarray, sums: np.ndarray) -> np.ndarray:
    alpha = np.empty(scores.shape[0], np.float32)
    for r in range(scores.shape[0]):
        alpha[r] = softmax_row16(scores, np.int64(r * 16), m, sums, np.int64(r))
    return alpha


def test_softmax_row16_matches_float64() -> None:
    """One online-softmax step per row: a first tile (m = -inf), a tile that raises the max, one
    that does not, masked (-inf) keys, large logits; against float64."""
    rng = np.random.default_rng(3)
    scores = (rng.standard_normal((6, 16)) * 20).astype(np.float32)
    scores[2, 3:] = -np.inf
    scores[5, 1:] = -np.inf
    m_old = np.array([-np.inf, 5.0, -np.inf, 80.0, -30.0, 1.0], np.float32)
    l_old = np.array([0.0, 2.5, 0.0, 1.0, 7.0, 3.0], np.float32)
    s64 = scores.astype(np.float64)
    m, sums = m_old.copy(), l_old.copy()
    alpha = _softmax_rows(scores, m, sums)
    m_new = np.maximum(m_old.astype(np.float64), s64.max(axis=1))
    want_alpha = np.exp(m_old - m_new)
    want_p = np.exp(s64 - m_new[:, None])
    np.testing.assert_allclose(m, m_new, rtol=0, atol=0)
    np.testing.assert_allclose(alpha, want_alpha, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(scores, want_p, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(sums, l_old * want_alpha + want_p.sum(axis=1), rtol=2e-6)
    assert alpha[3] == 1.0   # the max did not move: the accumulator is left as it is
