"""Slot arithmetic: where token `pos` of a sequence lives physically."""

from __future__ import annotations

from collections.abc import Sequence


def slot_range(block_table: Sequence[int], block_size: int, start: int, end: int) -> tuple[int, ...]:
    """Slots of token positions `start … end-1` (slot = block_id * block_size + offset).

    Built one block at a time from ranges, so a long prefill costs one `extend` per
    block rather than Python arithmetic per token.
    """
    out: list[int] = []
    pos = start
    i = start // block_size
    while pos < end:
        block_start = i * block_size
        base = block_table[i] * block_size - block_start
        stop = min(end, block_start + block_size)
        out.extend(range(base + pos, base + stop))
        pos = stop
        i += 1
    return tuple(out)
