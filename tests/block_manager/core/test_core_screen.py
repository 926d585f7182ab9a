"""The batched append's screen (append.py `_screen`, `_known_rows`): a large batch of one pool
proves its ids known and distinct through its row lookup, a decode batch (every count 1)
skips the passes its counts make moot. Whatever the batch holds — duplicates, unknown ids,
ids of a second pool, bools or zeros among the counts, token ids that do not add up — the
answers and the state are those of the item-by-item path, for batch sizes around
`VECTOR_MIN_ITEMS`."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import block_manager.core.append as append_mod
from block_manager.core import BlockManager, CoreError


def _manager() -> BlockManager:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", 4000, 4)
    m.add_pool("q", 400, 4)
    for i in range(90):
        m.allocate(f"s{i}", "p", [i] * (3 + i % 5))
    for i in range(5):
        m.allocate(f"q{i}", "q", [i, 1, 2])
    for pid in ("p", "q"):
        out = m.close_step(pid)
        if out is not None:
            m.settle_steps(pid, out.step_id)
    return m


def _outcome(m: BlockManager, ids: list[str], counts: list[Any], toks: Any) -> Any:
    try:
        out = m.append_tokens(ids, counts, toks)
    except CoreError as exc:
        return ("raised", type(exc).__name__)
    return out.num_tokens, [(i, type(e).__name__) for i, e in out.failures], sorted(out.copy_ops)


_ids = st.one_of(st.integers(0, 89).map(lambda i: f"s{i}"),              # known, pool p
                 st.integers(0, 4).map(lambda i: f"q{i}"),               # pool q
                 st.just("nope"))                                        # unknown


@given(size=st.sampled_from([1, 2, 62, 63, 64, 65, 66, 80, 90]), data=st.data())
@settings(max_examples=80, deadline=None)
def test_screen_answers_as_item_by_item(size: int, data: st.DataObject) -> None:
    clean = data.draw(st.booleans())
    if clean:   # distinct known ids of pool p: the row-lookup screen
        ids = [f"s{i}" for i in data.draw(st.permutations(range(90)))[:size]]
    else:
        ids = data.draw(st.lists(_ids, min_size=size, max_size=size))
    counts: list[Any] = data.draw(st.one_of(
        st.just([1] * size),
        st.lists(st.sampled_from([1, 1, 1, 2, 5]), min_size=size, max_size=size),
        st.lists(st.sampled_from([1, 1, 0, True, 3]), min_size=size, max_size=size)))
    with_ids = data.draw(st.sampled_from(["array", "list", "none", "short"]))
    total = sum(c for c in counts if type(c) is int and c > 0)
    toks: Any = None
    if with_ids == "array":
        toks = array("q", range(total))
    elif with_ids == "list":
        toks = list(range(total))
    elif with_ids == "short":
        toks = array("q", range(max(0, total - 1)))
    answers = []
    for vector_min in (10**9, append_mod.VECTOR_MIN_ITEMS):
        m = _manager()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(append_mod, "VECTOR_MIN_ITEMS", vector_min)
            got = _outcome(m, ids, counts, toks)
        assert m.fsck() == []
        answers.append((got, m.to_snapshot()))
    assert answers[0] == answers[1]


def test_known_rows_refuses_duplicates_and_other_pools() -> None:
    """The row lookup says None (check the slow way) for a duplicate, an unknown id or an id
    of another pool, and gives the rows of a clean batch."""
    m = _manager()
    seqs, pools = m._seqs, m._pools   # noqa: SLF001 - the screen's inputs
    ids = [f"s{i}" for i in range(70)]
    rows = append_mod._known_rows(seqs, pools, ids)   # noqa: SLF001
    assert rows is not None and rows.tolist() == [pools["p"].cols.row_of[s] for s in ids]
    assert append_mod._known_rows(seqs, pools, [*ids, "s3"]) is None   # noqa: SLF001
    assert append_mod._known_rows(seqs, pools, [*ids, "q1"]) is None   # noqa: SLF001
    assert append_mod._known_rows(seqs, pools, [*ids, "nope"]) is None   # noqa: SLF001
    assert append_mod._known_rows(seqs, pools, ["nope", *ids]) is None   # noqa: SLF001
