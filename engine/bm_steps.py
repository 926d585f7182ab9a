"""Sending the engine's Steps so that an unreachable block manager is waited out, not fatal.

A Step whose answer never came (UNAVAILABLE, DEADLINE_EXCEEDED after the client's own retries:
a block manager restarting, a network blip) may or may not have been applied. Sending a *new*
Step would then risk doing its frees, admissions and reports twice; so the same request is
resent under its request id, which the block manager applies at most once and answers from its
journal when it has (also across its restarts), before anything new is sent. The step's nodes
and requests simply wait. Which errors mean "unreachable" is the failure table's (its STEP rows
whose action is RESEND); this is that action's one executor.
"""

from __future__ import annotations

import time

from block_manager.client import StepResult, SyncStep
from engine.errors import EngineFailure
from engine.failure_policy import Action, Item, errors_for
from pagedkv.logging import get_logger

UNREACHABLE = errors_for(Item.STEP, Action.RESEND)   # the block manager's answer is unknown: resend
FIRST_WAIT_S = 0.1
MAX_WAIT_S = 2.0
log = get_logger("engine.bm_steps")


class StepSender:
    """Commits step batches; keeps the one whose answer never came until it is answered."""

    __slots__ = ("timeout_s", "first_wait_s", "unanswered", "num_resends")
    timeout_s: float                  # how long a waiting commit resends before EngineFailure
    first_wait_s: float               # the first wait before a resend, doubling up to MAX_WAIT_S
    unanswered: SyncStep | None       # a batch sent without `wait` whose answer never came
    num_resends: int

    def __init__(self, timeout_s: float, *, first_wait_s: float = FIRST_WAIT_S) -> None:
        self.timeout_s = timeout_s
        self.first_wait_s = first_wait_s
        self.unanswered = None
        self.num_resends = 0

    def commit(self, batch: SyncStep, *, wait: bool = True) -> StepResult:
        """`batch.commit()`. Unanswered: resent until answered (`wait`), or kept for the next
        `drain` (no `wait`: an idle flush), and the error raised."""
        try:
            return batch.commit()
        except UNREACHABLE as exc:
            if not wait:
                self.unanswered = batch
                raise
            return self._resend(batch, exc)

    def drain(self, *, wait: bool) -> None:
        """Resend the kept unanswered batch, before any new Step: until answered (`wait`) or
        once (raising the error and keeping it)."""
        batch, self.unanswered = self.unanswered, None
        if batch is None:
            return
        try:
            if wait:
                self._resend(batch, None)
            else:
                self.num_resends += 1
                batch.resend()
        except UNREACHABLE:
            self.unanswered = batch
            raise

    def _resend(self, batch: SyncStep, error: BaseException | None) -> StepResult:
        """Resend with backoff until the block manager answers; EngineFailure after
        `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        wait = self.first_wait_s
        while True:
            log.warning("block_manager_unreachable", error=str(error), retry_in_s=wait)
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            self.num_resends += 1
            try:
                result = batch.resend()
            except UNREACHABLE as exc:
                error = exc
                if time.monotonic() >= deadline:
                    raise EngineFailure(
                        f"the block manager stayed unreachable for {self.timeout_s:.0f} s: {exc}"
                    ) from exc
                wait = min(wait * 2, MAX_WAIT_S)
                continue
            log.info("block_manager_back", resends=self.num_resends)
            return result


__all__ = ["UNREACHABLE", "StepSender"]
