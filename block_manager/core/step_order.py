"""Which free blocks a host→device move of the open step may take, given the order in which a
node runs a step.

A compute node runs a step's work in a fixed order (compute_node/host_pool.apply_moves): the
device→host moves, then the host→device moves (one batched scatter), then the copy ops in
order, then the Forward's token writes. A block that an op of the open step still names can
lose its last holder in that same step — the other sharer of a copy-on-write source freed,
a sequence dropped by a failure report, a swapped-in sequence freed again — and is then free
at once. That is fine for blocks filled by token writes (they come last) and for a
device→host source (read before any move of the step writes), but not for the destination of
a host→device move (swap-in, onboard), which lands *before* the step's copies:

- into a copy-on-write copy's source: the copy would read the moved-in block;
- into a copy's destination: the copy would overwrite the moved-in block;
- into another host→device destination of the step: both land in one scatter, in no
  defined order.

So those destinations skip such blocks (`BlockTaker`), and the room checks count them out
(`early_room`). Defrag copies are not among them: their blocks stay reserved or pinned while
the plan stands, and aborting a plan still in the open step takes its copies out of the step
(defrag.abort).
"""

from __future__ import annotations

from collections.abc import Collection

from block_manager.core import defrag as _defrag
from block_manager.core.block_list import BlockList
from block_manager.core.pool import Pool
from block_manager.core.step_work import StepWork

_TO_DEVICE = frozenset(("swap_in", "onboard"))


def busy_blocks(step: StepWork) -> set[int]:
    """Device blocks a host→device move of `step` must not write: the sources and destinations
    of its copy-on-write copies and the destinations of its host→device moves so far."""
    busy: set[int] = {b for op in step.copy_ops if op.kind == "cow" for b in (op.src, op.dst)}
    busy.update(op.dst for op in step.tier_ops if op.kind in _TO_DEVICE)
    return busy


def _num_idle(pool: Pool, busy: set[int], taken: Collection[int]) -> int:
    """Busy blocks in the free or cached queue (ref 0 and not reserved), other than `taken`
    (device hits the same call takes out of the queue)."""
    ref, reserved = pool.ref_cnt, pool.reserved
    return sum(1 for b in busy if ref[b] == 0 and not reserved[b] and b not in taken)


def _num_idle_reclaimed(pool: Pool, busy: set[int]) -> int:
    """Busy blocks that reclaiming the pool's unsent defrag plan would put into the free queue."""
    plan = pool.plan
    if plan is None or plan.step_id != pool.step.step_id:
        return 0
    ref = pool.ref_cnt
    return sum((op.dst in busy) + (ref[op.src] == 0 and op.src in busy) for op in plan.moves)


def early_room(pool: Pool, busy: set[int], taken: Collection[int] = (), reclaim: bool = False) -> int:
    """How many fresh blocks a host→device move may take now: the free and evictable ones
    outside `busy` and `taken`, with those of the pool's unsent defrag plan when `reclaim`."""
    room = pool.num_available - len(taken) - _num_idle(pool, busy, set(taken))
    if reclaim:
        room += _defrag.unsent_plan_blocks(pool) - _num_idle_reclaimed(pool, busy)
    return room


class BlockTaker:
    """`Pool.take_block` that passes over the busy blocks at the front of the free queue (and,
    once it is empty, of the cached queue) and puts them back where they were, order kept, by
    `done()`: the free-queue order a snapshot records is what it would have been without them."""

    __slots__ = ("pool", "busy", "_aside_free", "_aside_cached")

    def __init__(self, pool: Pool, busy: set[int]) -> None:
        self.pool = pool
        self.busy = busy
        self._aside_free: list[int] = []
        self._aside_cached: list[int] = []

    def _set_aside(self, queue: BlockList, aside: list[int]) -> None:
        busy = self.busy
        while (b := queue.first()) is not None and b in busy:
            queue.pop_front()
            aside.append(b)

    def take(self) -> int:
        """A fresh block outside the busy set (the caller counted the room: `early_room`)."""
        pool = self.pool
        if self.busy:
            self._set_aside(pool.free_list, self._aside_free)
            if not pool.free_list.length:
                self._set_aside(pool.cached_list, self._aside_cached)
        return pool.take_block()

    def done(self) -> None:
        """Put the passed-over blocks back at the fronts of their queues, in their order."""
        for queue, aside in ((self.pool.free_list, self._aside_free), (self.pool.cached_list, self._aside_cached)):
            for b in reversed(aside):
                queue.push_front(b)
            aside.clear()


__all__ = ["BlockTaker", "busy_blocks", "early_room"]
