"""A batch's block takes served from one pop of the free list (`BlockList.pop_front_many`,
`FreeRun` in pool.py) and the crossings that take them in the request-ordered loop
(append_batch.py): block for block what `take_block` one at a time gives, at the boundaries
between the array and the per-item paths (batch sizes around `VECTOR_MIN_ITEMS`, runs around
`RUN_MIN_BLOCKS`)."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import block_manager.core.append as append_mod
import block_manager.core.append_batch as batch_mod
from block_manager.core import BlockManager
from block_manager.core.block_list import BlockList
from block_manager.core.pool import FreeRun, Pool


def _members(bl: BlockList) -> list[int]:
    return list(bl)


@given(num_blocks=st.integers(1, 100), data=st.data())
@settings(max_examples=60, deadline=None)
def test_pop_and_push_many_match_one_at_a_time(num_blocks: int, data: st.DataObject) -> None:
    order = data.draw(st.permutations(range(num_blocks)))
    a, b = BlockList(num_blocks), BlockList(num_blocks)
    for x in order:
        a.push_back(x)
        b.push_back(x)
    n = data.draw(st.integers(0, num_blocks))
    ref = array("q", bytes(8 * num_blocks))
    got = a.pop_front_many(n, ref)
    want = [b.pop_front() for _ in range(n)]
    assert got == want
    assert _members(a) == _members(b) and a.length == b.length and a.check() == []
    assert list(ref) == [1 if x in want else 0 for x in range(num_blocks)]
    k = data.draw(st.integers(0, n))
    a.push_front_many(got[n - k:], ref)   # the unused tail goes back
    for back in reversed(got[n - k:]):
        b.push_front(back)
    assert _members(a) == _members(b) and a.length == b.length and a.check() == []
    assert sum(ref) == n - k


def _pool_with_cache(num_blocks: int, num_cached: int, rng: random.Random) -> Pool:
    """A pool whose free list holds the plain blocks and whose cached list `num_cached` hashed ones."""
    m: Any = BlockManager(watermark=0.0)
    m.add_pool("p", num_blocks, 2)
    for i in range(num_cached):
        m.allocate(f"c{i}", "p", [i, rng.randrange(9), 7])   # one full block, hashed
    if m.close_step("p") is not None:
        m.settle_steps("p", 1)
    m.free([f"c{i}" for i in range(num_cached)])
    return m._pools["p"]   # noqa: SLF001 - the pool itself is what is under test


@given(st.integers(0, 12), st.integers(0, 16), st.integers(0, 20), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_free_run_takes_what_take_block_would(num_cached: int, expected: int, num_takes: int,
                                              rng: random.Random) -> None:
    """Whatever the run expected (too few, exactly, too many): the same blocks in the same order,
    evictions included, and after `close` the same free and cached queues and counters."""
    a = _pool_with_cache(40, num_cached, rng)
    b = _pool_with_cache(40, num_cached, random.Random(0))
    num_takes = min(num_takes, a.num_available)
    run = FreeRun(a, expected)
    assert run.available == b.num_available
    got = [run.take() for _ in range(num_takes)]
    run.close()
    want = [b.take_block() for _ in range(num_takes)]
    assert got == want
    assert list(a.free_list) == list(b.free_list) and list(a.cached_list) == list(b.cached_list)
    assert (a.num_used, a.evictions, a.num_available) == (b.num_used, b.evictions, b.num_available)
    assert list(a.ref_cnt) == list(b.ref_cnt)


# ---- the batched append: runs popped up front vs one take_block at a time --------------------

def _trace(seed: int, batch_sizes: list[int]) -> list[Any]:
    """Answers and snapshots of a trace of Steps of the given batch sizes: admissions with shared
    prefixes, forks (copy-on-write, some pending), frees, decode and multi-token appends that
    cross or fill blocks, late ids, a pool small enough to evict."""
    rng = random.Random(seed)
    m: Any = BlockManager(watermark=0.0)   # (plain str ids: the NewTypes are for the core's own code)
    m.add_pool("p", 420, 4)
    prefixes = [[rng.randrange(30) for _ in range(12)] for _ in range(3)]
    live: list[str] = []
    late: set[str] = set()
    nxt = 0
    seen: list[Any] = []
    for size in batch_sizes:
        out = m.close_step("p")
        if out is not None:
            fail = rng.random() < 0.05
            seen.append(m.settle_steps("p", out.step_id - fail, out.step_id if fail else None))
        live = [s for s in live if m.has_sequence(s)]
        late &= set(live)
        if late:
            ids = sorted(late)
            ids_late = [rng.randrange(30) for _ in ids]
            seen.append([(i, repr(e)) for i, e in m.resolve_late(ids, [1] * len(ids), ids_late)])
            late.clear()
        for sid in rng.sample(live, min(len(live), rng.randint(0, 3))):
            try:
                m.free([sid])
                live.remove(sid)
            except Exception as exc:  # noqa: BLE001 - the answer is what is compared
                seen.append(repr(exc))
        while len(live) < size:
            sid = f"s{nxt}"
            nxt += 1
            prompt = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randrange(30) for _ in range(rng.randint(0, 5))]
            try:
                m.allocate(sid, "p", prompt)
                live.append(sid)
            except Exception as exc:  # noqa: BLE001
                seen.append(repr(exc))
                break
        for parent in rng.sample(live, min(len(live), rng.randint(0, 2))):
            child = f"s{nxt}"
            nxt += 1
            try:
                m.fork(parent, [child])
                live.append(child)
            except Exception as exc:  # noqa: BLE001
                seen.append(repr(exc))
        ids = live[:size]
        counts = [1 if rng.random() < 0.7 else rng.randint(1, 9) for _ in ids]
        num_late = [1 if rng.random() < 0.1 else 0 for _ in ids]
        toks = array("q", [rng.randrange(30) for _ in range(sum(counts))])
        res = m.append_tokens(ids, counts, toks, num_late=num_late)
        seen.append((res.num_tokens, [(i, repr(e)) for i, e in res.failures], sorted(res.copy_ops.items())))
        late |= {sid for sid, k, n, f in zip(ids, num_late, res.num_tokens, counts) if k and n}
        seen.append(m.to_snapshot())
    assert m.fsck() == []
    return seen


@pytest.mark.parametrize("run_min", [0, 1, batch_mod.RUN_MIN_BLOCKS, 10**9])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batched_append_equals_item_by_item(monkeypatch: pytest.MonkeyPatch, run_min: int, seed: int) -> None:
    """Batches around the vector threshold (63, 64, 65 items, and small ones), runs of every
    length: the same answers and the same state, step after step, as the item-by-item path."""
    sizes = [1, 5, 63, 64, 65, 64, 30, 65, 63, 64, 64, 70, 64, 65]
    monkeypatch.setattr(append_mod, "VECTOR_MIN_ITEMS", 10**9)
    want = _trace(seed, sizes)
    monkeypatch.setattr(append_mod, "VECTOR_MIN_ITEMS", 64)
    monkeypatch.setattr(batch_mod, "RUN_MIN_BLOCKS", run_min)
    assert _trace(seed, sizes) == want
    monkeypatch.setattr(append_mod, "VECTOR_MIN_ITEMS", 1)
    assert _trace(seed, sizes) == want


@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=60), st.integers(1, 9),
       st.sampled_from([None, "", "salt", "é"]), st.sampled_from([None, b"\x07" * 32]))
@settings(max_examples=100, deadline=None)
def test_hash_prefix_is_the_chain_of_block_hashes(tokens: list[int], block_size: int, salt: str | None,
                                                  parent: bytes | None) -> None:
    """The prompt hashed from one buffer equals the definition, block by block."""
    from block_manager.core.hashing import hash_block, hash_prefix

    want: list[bytes] = []
    chain = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chain = hash_block(chain, tokens[start:start + block_size], salt)
        want.append(chain)
    assert hash_prefix(tokens, block_size, salt, parent) == want
