"""The records of a pool's steps: what the open step has recorded so far (`StepWork`), what a
closed step awaiting its Forward report would have to undo (`StepRecord`), and the notes a
call makes in the open step when it creates, changes or drops a table. The sequencer that
closes and settles steps is steps.py; these records sit below the pool, which owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from block_manager.core.fetch import FetchOp, ServeGrant
from block_manager.core.sequence import Sequence
from block_manager.core.tiers import TierOp
from block_manager.core.types import CopyOp, PlanId, SeqId, StepId


class DirtyTable(NamedTuple):
    """A table touched in the open step: how it looked when the step first touched it.

    A named tuple, not a slotted dataclass (issue 45): one is made for every table a step
    changes — each block crossing of a decode batch — and `tuple.__new__` (`touch`) costs
    no Python frame. Its fields are never reassigned; `replaced` grows in place, so every
    instance gets its own set (there is no default)."""

    created: bool          # new in this step: its delta is the whole table
    base_version: int
    base_len: int
    covered: int           # created tables: positions already covered (cached prefix / parent's tokens)
    replaced: set[int]     # positions < base_len rewritten


_new_dirty = tuple.__new__   # a `DirtyTable` from its field tuple, without the named tuple's Python constructor


@dataclass(slots=True)
class StepWork:
    """The open step of a pool: what it has recorded so far."""

    step_id: StepId
    copy_ops: list[CopyOp] = field(default_factory=list)
    dirty: dict[SeqId, DirtyTable] = field(default_factory=dict)
    dropped: list[SeqId] = field(default_factory=list)
    registrations: list[tuple[int, bytes]] = field(default_factory=list)  # (block, hash) filled here
    plan_id: PlanId | None = None
    has_writes: bool = False
    reset: bool = False   # the pool changed hands: the node forgets every table it holds first
    base_step_id: int | None = None  # set after a failure report: the last step to build on
    tier_ops: list[TierOp] = field(default_factory=list)  # device<->host moves (tiers.py), run first
    fetches: list[FetchOp] = field(default_factory=list)  # blocks pulled from other nodes (fetch.py)
    serves: list[ServeGrant] = field(default_factory=list)  # blocks this node serves to others (fetch.py)

    @property
    def has_work(self) -> bool:
        """Whether the node must run something for this step (writes, copies, a reset). New,
        changed or dropped tables alone wait in the open step: nothing reads them before the
        next step that writes, whose Forward applies them first."""
        return bool(self.has_writes or self.copy_ops or self.plan_id is not None or self.reset or self.tier_ops
                    or self.serves)


@dataclass(slots=True)
class StepRecord:
    """A closed step awaiting its Forward report: what a failure would have to undo."""

    step_id: StepId
    registrations: list[tuple[int, bytes]]
    plan_id: PlanId | None
    base_step_id: int   # the step it was built on: where the node stands if this one fails


def touch(step: StepWork, seq: Sequence) -> DirtyTable:
    """Record the table of an existing sequence before the step changes it."""
    d = step.dirty.get(seq.seq_id)
    if d is None:
        d = step.dirty[seq.seq_id] = _new_dirty(DirtyTable, (False, seq.version, len(seq.block_table), 0, set()))
    return d


def note_created(step: StepWork, seq: Sequence, covered: int) -> None:
    step.dirty[seq.seq_id] = DirtyTable(True, 0, 0, covered, set())


def note_replaced(step: StepWork, seq: Sequence, position: int) -> None:
    """Table entry `position` of an existing sequence gets another block in this step."""
    d = touch(step, seq)
    if not d.created and position < d.base_len:
        d.replaced.add(position)


def note_dropped(step: StepWork, seq_id: SeqId) -> None:
    """The sequence is gone; a node that knows it drops its table (one created in this very
    step was never announced, so it simply disappears from the step)."""
    d = step.dirty.pop(seq_id, None)
    if d is None or not d.created:
        step.dropped.append(seq_id)


def base_step(step: StepWork) -> int:
    """The step the open step builds on: the previous one, unless a failure report said otherwise."""
    return step.step_id - 1 if step.base_step_id is None else step.base_step_id


__all__ = ["DirtyTable", "StepRecord", "StepWork", "base_step", "note_created", "note_dropped", "note_replaced",
           "touch"]
