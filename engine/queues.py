"""Where each sequence is: the scheduler's queues, and the moves between them that the lifecycle
allows (`engine.sequence`). Owned by the `Scheduler`, shared with its `SwapPolicy`.

- `waiting`: WAITING and PREEMPTED sequences, admitted in order (a preempted one goes to the
  front: it has waited longest);
- `running`: RUNNING, in admission order (the most recently admitted last: preemption victims
  are taken from the end);
- `swapped`: SWAPPED, oldest first (they come back before new admissions);
- `to_free`: the admissions the engine must free with its next Step (finished or preempted
  sequences whose blocks still exist).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.sequence import SeqStatus, Sequence
from engine.stats import EngineStats


@dataclass(slots=True)
class SeqQueues:
    stats: EngineStats
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    swapped: deque[Sequence] = field(default_factory=deque)
    to_free: list[str] = field(default_factory=list)

    def admit(self, seq: Sequence, seq_id: str, node_id: str, num_computed: int) -> None:
        """A queued sequence the block manager admitted as `seq_id` on `node_id`."""
        self.waiting.remove(seq)
        seq.admit(seq_id, node_id, num_computed)
        self.running.append(seq)

    def preempt(self, seq: Sequence, *, free: bool) -> None:
        """RUNNING -> PREEMPTED, back to the front of the queue with everything it has as its
        prompt. `free`: its blocks still exist (the id goes out with the next Step); otherwise
        they went with its node. A sequence no longer running is left alone."""
        if seq.status is not SeqStatus.RUNNING:
            return
        self.running.remove(seq)
        self.stats.recomputed_tokens += seq.num_computed
        self.requeue(seq, free=free)

    def requeue(self, seq: Sequence, *, free: bool) -> None:
        """Preempt a sequence already out of `running` / `swapped` to recompute it."""
        held = seq.preempt()
        if free and held is not None:
            self.to_free.append(held)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Out of whichever queue holds it, FINISHED; what it held is freed with the next Step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        held = seq.finish()
        if held is not None:
            self.to_free.append(held)

    def forget_frees(self, dropped_ids: Collection[str]) -> None:
        """Forget the pending frees of sequences the block manager dropped (a failed step's
        report): it holds nothing of them, and a free of one is a DoubleFree."""
        if dropped_ids:
            self.to_free = [sid for sid in self.to_free if sid not in dropped_ids]

    def take_frees(self) -> list[str]:
        """The pending frees, handed to the Step that carries them from here on."""
        freeing, self.to_free = self.to_free, []
        return freeing


__all__ = ["SeqQueues"]
