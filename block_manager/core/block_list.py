"""An intrusive doubly-linked list of block ids over preallocated arrays.

Blocks are small integers, so the links live in two flat lists indexed by block id
(plus one sentinel slot) instead of in node objects: push, pop and removal of an
arbitrary member are O(1) with no allocation, which is what keeps allocation and release
constant-time however large the pool is (a `deque.remove` would scan). A batch pops or
puts back many blocks in one call (`pop_front_many`): the links stay Python lists because
per-block operations on them are what every take and release does (int64 arrays with numpy
views, for a compiled loop, made those ~2x slower and a decode step ~10% dearer: issue 45).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_NIL = -1


class BlockList:
    """Ordered set of block ids in `0 … num_blocks-1` with O(1) ends and removal.

    `length` is a plain attribute (read-only outside this class) so hot paths can read
    it without a `__len__` call.
    """

    __slots__ = ("_prev", "_next", "_head", "length")

    def __init__(self, num_blocks: int) -> None:
        # Slot `num_blocks` is the sentinel: _next[head] is the first member,
        # _prev[head] the last. Non-members have _prev == _NIL.
        self._head = num_blocks
        self._prev = [_NIL] * (num_blocks + 1)
        self._next = [_NIL] * (num_blocks + 1)
        self._prev[num_blocks] = num_blocks
        self._next[num_blocks] = num_blocks
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __contains__(self, block_id: int) -> bool:
        return self._prev[block_id] != _NIL

    def __iter__(self) -> Iterator[int]:
        nxt = self._next
        head = self._head
        b = nxt[head]
        while b != head:
            yield b
            b = nxt[b]

    def first(self) -> int | None:
        b = self._next[self._head]
        return None if b == self._head else b

    def push_front(self, block_id: int) -> None:
        head = self._head
        first = self._next[head]
        self._prev[block_id] = head
        self._next[block_id] = first
        self._prev[first] = block_id
        self._next[head] = block_id
        self.length += 1

    def push_back(self, block_id: int) -> None:
        head = self._head
        last = self._prev[head]
        self._prev[block_id] = last
        self._next[block_id] = head
        self._next[last] = block_id
        self._prev[head] = block_id
        self.length += 1

    def pop_front(self) -> int | None:
        head = self._head
        b = self._next[head]
        if b == head:
            return None
        nxt = self._next[b]
        self._next[head] = nxt
        self._prev[nxt] = head
        self._prev[b] = _NIL
        self._next[b] = _NIL
        self.length -= 1
        return b

    def remove(self, block_id: int) -> None:
        prv = self._prev[block_id]
        nxt = self._next[block_id]
        self._next[prv] = nxt
        self._prev[nxt] = prv
        self._prev[block_id] = _NIL
        self._next[block_id] = _NIL
        self.length -= 1

    def pop_front_many(self, n: int, ref_cnt: array) -> list[int]:
        """The first `n` members, popped in order, each given `ref_cnt` 1 (what `n` calls of
        `pop_front` give; the caller checked `n <= length`)."""
        prv, nxt, head = self._prev, self._next, self._head
        blocks: list[int] = []
        b = nxt[head]
        for _ in range(n):
            after = nxt[b]
            prv[b] = _NIL
            nxt[b] = _NIL
            ref_cnt[b] = 1
            blocks.append(b)
            b = after
        nxt[head] = b
        prv[b] = head
        self.length -= n
        return blocks

    def push_front_many(self, blocks: list[int], ref_cnt: array) -> None:
        """Undo `pop_front_many` for `blocks` (popped in that order): back at the front in the
        same order, ref_cnt 0."""
        for b in reversed(blocks):
            self.push_front(b)
            ref_cnt[b] = 0

    def check(self) -> list[str]:
        """Linkage consistency (for fsck): forward and backward walks agree with the count."""
        problems: list[str] = []
        head = self._head
        seen = 0
        b = self._next[head]
        prev = head
        while b != head:
            if b < 0 or b >= head:
                problems.append(f"link to out-of-range block {b}")
                return problems
            if self._prev[b] != prev:
                problems.append(f"block {b}: prev link {self._prev[b]} != {prev}")
            prev = b
            b = self._next[b]
            seen += 1
            if seen > self.length + 1:
                problems.append("cycle in list")
                return problems
        if self._prev[head] != prev:
            problems.append("tail link inconsistent")
        if seen != self.length:
            problems.append(f"length {self.length} but {seen} members linked")
        members = sum(1 for i in range(head) if self._prev[i] != _NIL)
        if members != self.length:
            problems.append(f"{members} blocks marked as members, length {self.length}")
        return problems
