"""`hash_rows` (the batched append's hashing of the blocks a step filled, hashing.py) is the
block hash of each row, chained from that row's own parent with its own salt."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager.core.hashing import hash_block, hash_rows, salt_bytes


@given(st.integers(1, 9), st.data())
@settings(max_examples=100, deadline=None)
def test_hash_rows_is_the_block_hash_of_each_row(block_size: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 6))
    rows = [data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=block_size, max_size=block_size))
            for _ in range(n)]
    parents = [data.draw(st.sampled_from([None, b"\x07" * 32, bytes(range(32))])) for _ in range(n)]
    salts = [data.draw(st.sampled_from([None, "", "salt", "é"])) for _ in range(n)]
    flat = array("q", [t for row in rows for t in row]).tobytes()
    got = hash_rows(parents, [salt_bytes(s) for s in salts], block_size.to_bytes(4, "little"), flat)
    assert got == [hash_block(p, row, s) for p, row, s in zip(parents, rows, salts)]
