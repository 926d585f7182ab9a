"""Decode attention over shared prefix blocks (`kernels.cpu.decode_cascade`) against the float64
reference, its plan (which sequences share which blocks), and the step's choice of it.

Cases: several groups with different prefixes, tables that share some leading blocks and then
diverge, members whose context ends one token after the prefix or exactly on a block edge
(the shared prefix must stop before each member's last token), sequences that share nothing,
partial last blocks, shuffled pools, GQA groups of 3 and 7 and MQA, serial and parallel.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from paged_cases import assert_close_rel
from test_cpu_step import REL, begin, expected, make_step

from kernels import KernelInputError, reference
from kernels.cpu import _parallel, decode_cascade, prefill_flash

BS = 16


def _shared_tables(rng: np.random.Generator, lens: list[int], prefixes: list[tuple[int, int]],
                   num_blocks: int) -> np.ndarray:
    """Block tables over a shuffled pool where sequence i copies the first `blocks` entries of
    sequence `source` for each (source, blocks) in `prefixes` (-1: own blocks only)."""
    pool = list(rng.permutation(num_blocks))
    width = max(-(-n // BS) for n in lens)
    tables = np.full((len(lens), width), -1, np.int32)
    for i, n in enumerate(lens):
        source, blocks = prefixes[i]
        own = [pool.pop() for _ in range(-(-n // BS) - max(blocks, 0))]
        head = list(tables[source, :blocks]) if source >= 0 else []
        tables[i, :-(-n // BS)] = head + own
    return tables


# (seq_len, (source sequence, shared blocks)): two groups (seqs 0-4 on seq 0's 16 blocks, one
# diverging after 9; seqs 5-7 on seq 5's 3 blocks), a member ending 1 token after the prefix
# (257), one ending on a block edge (256: only 15 blocks can be shared), loners
LENS = [300, 290, 257, 256, 330, 60, 49, 64, 20, 1, 400]
PREFIXES = [(-1, 0), (0, 16), (0, 16), (0, 15), (0, 9), (-1, 0), (5, 3), (5, 3), (-1, 0), (-1, 0), (-1, 0)]


def _case(seed: str, num_heads: int, num_kv_heads: int, spread: float = 3.0) -> tuple[Any, ...]:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    num_blocks = sum(-(-n // BS) for n in LENS) + 4
    tables = _shared_tables(rng, LENS, PREFIXES, num_blocks)
    kc = rng.standard_normal((num_blocks, num_kv_heads, BS, 64), dtype=np.float32)
    vc = rng.standard_normal((num_blocks, num_kv_heads, BS, 64), dtype=np.float32)
    query = rng.standard_normal((len(LENS), num_heads, 64), dtype=np.float32) * spread
    return query, kc, vc, tables, np.array(LENS, np.int32)


def test_plan_groups_and_covers_every_row_once() -> None:
    _, _, _, tables, lens = _case("plan", 9, 3)
    order, items = decode_cascade.cascade_plan(tables, lens, BS, group=3, num_kv_heads=3) or (None, None)
    assert order is not None and items is not None
    assert sorted(order.tolist()) == list(range(len(LENS)))
    seen = np.zeros((len(LENS), 3), np.int64)
    prefix_of: dict[int, int] = {}
    for first, count, prefix, head in items:
        seqs = order[first:first + count]
        assert 1 <= count <= max(1, decode_cascade.CHUNK_ROWS // 3)
        seen[seqs, head] += 1
        for s in seqs:
            prefix_of[int(s)] = int(prefix)
            assert prefix * BS < lens[s]                                  # a key of its own left
            assert (tables[s, :prefix] == tables[seqs[0], :prefix]).all()  # the prefix is shared
    assert (seen == 1).all()
    # seqs 0-4 share seq 0's first 9 blocks (seq 4 diverges there); 5-7 share 3; loners none
    assert [prefix_of[s] for s in range(len(LENS))] == [9, 9, 9, 9, 9, 3, 3, 3, 0, 0, 0]


def test_plan_none_without_sharing() -> None:
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert decode_cascade.cascade_plan(tables, np.array([64, 40, 17], np.int32), BS, 3, 3) is None
    one_block = np.array([[0, 1], [0, 2]], np.int32)   # the shared block holds a last token
    assert decode_cascade.cascade_plan(one_block, np.array([16, 20], np.int32), BS, 3, 3) is None


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (14, 2), (4, 1)], ids=["gqa3", "gqa7", "mqa"])
def test_matches_float64_reference(serial: bool, num_heads: int, num_kv_heads: int) -> None:
    query, kc, vc, tables, lens = _case(f"{serial}{num_heads}", num_heads, num_kv_heads)
    plan = decode_cascade.cascade_plan(tables, lens, BS, num_heads // num_kv_heads, num_kv_heads)
    assert plan is not None
    out = np.full(query.shape, np.nan, np.float32)
    with _parallel.parallel_section(serial):
        decode_cascade.cascade_decode(serial, query, kc.view(np.uint16), vc.view(np.uint16), tables, lens, plan,
                                      np.float32(0.125), out)
    want = reference.paged_attention_decode(query.astype(np.float64), kc, vc, tables, lens, 0.125)
    assert_close_rel(out, np.asarray(want), 1e-4)


def _shared_step(rng: np.random.Generator) -> Any:
    """A step with decode sequences 1-3 sharing sequence 0's leading blocks, and prefill rows."""
    case = make_step(rng, [200, 180, 77, 161, 9], [(90, 30), (20, 20)], num_heads=6, num_kv_heads=2)
    tables = case.dec_tables
    for s, blocks in ((1, 11), (2, 4), (3, 10)):   # before each one's last-token block: slots unchanged
        tables[s, :blocks] = tables[0, :blocks]
    return case


@pytest.mark.parametrize("preferred", [True, False])
def test_step_takes_cascade_where_blocks_are_shared(preferred: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the step takes the cascade where the CPU prefers the flash tiles and decode
    sequences share blocks (results against float64, decode and prefill rows in one step); asked
    for, it is refused for fp16 caches; with nothing shared the fused call's decode stays."""
    monkeypatch.setattr(prefill_flash, "preferred", lambda: preferred)
    case = _shared_step(np.random.default_rng(5))
    step = begin(case)
    assert (step.cascade is not None) == preferred
    for layer in range(2):
        want, _, _ = expected(case, layer)
        assert_close_rel(step.run(layer, case.query, case.keys[layer], case.values[layer]), want, REL["float32"])
    forced = begin(case, cascade_decode=True, serial=False)
    assert forced.cascade is not None and not forced.split
    want, _, _ = expected(case, 0)
    assert_close_rel(forced.run(0, case.query, case.keys[0], case.values[0]), want, REL["float32"])
    assert begin(case, cascade_decode=False).cascade is None
    apart = make_step(np.random.default_rng(6), [40, 50], [], num_heads=6, num_kv_heads=2)
    assert begin(apart, cascade_decode=True).cascade is None
    half = make_step(np.random.default_rng(7), [40], [], num_heads=6, num_kv_heads=2, kv_dtype="float16",
                     query_dtype="float16")
    assert begin(half).cascade is None
    with pytest.raises(KernelInputError, match="float32 caches"):
        begin(half, cascade_decode=True)
