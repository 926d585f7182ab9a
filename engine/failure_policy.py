"""What the engine does when part of a step fails: one table, (item kind x typed error) -> action.

Every refusal and fault the engine handles arrives as a typed error: the block manager's
per-item refusals (`block_manager.client`: out of blocks, pool gone, pool draining, a write
pending, invalid), its whole-Step failures (unreachable), a sequence the block manager dropped
with its node's epoch or held on a node out of placement, one held on a pool the fleet asks back or
handed to another engine (`engine.errors`, `engine.fleet_pools`), and a model node's failed step
(`engine.errors`: unreachable, moved on, refused). `action_for` looks the pair up, walking the
error's class hierarchy, so a subclass inherits its parent's row; a pair with no row stops the
engine. Nothing is decided by a status code or a reason string.

`POLICY` is the table; `ROW_NOTES` says in words what each row's action does to that item
(docs/architecture.md prints both, and tests/engine/test_failure_policy.py checks that the docs'
table is this one). Each action has exactly one executor: `Scheduler.enact`
(`engine.scheduler`), except RESEND, which only `StepSender` (`engine.bm_steps`) can do.
A node that moves on `MAX_REFUSALS_IN_A_ROW` steps in a row is not recovering: STOP_ENGINE
(`NodeRefusals`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from block_manager.client import (
    DeadlineExceededError,
    OutOfBlocksError,
    PendingWriteError,
    PoolDrainingError,
    PoolGoneError,
    UnavailableError,
)
from engine.errors import (
    EpochDropped,
    NodeMovedOn,
    NodeOutOfPlacement,
    NodeRefused,
    NodeUnreachable,
    PoolLost,
    PoolReleasing,
)

MAX_REFUSALS_IN_A_ROW = 20


class Item(Enum):
    """What failed: one item of a Step, the Step itself, a sequence the engine holds, or a
    node's step."""

    ADMISSION = "admission"
    APPEND = "append"
    FORK = "fork"
    SWAP_OUT = "swap-out"
    SWAP_IN = "swap-in"
    LATE_IDS = "late ids"
    HELD = "held sequence"      # running or swapped: the block manager dropped it
    STEP = "step"               # the whole block-manager Step
    NODE_STEP = "node step"


class Action(Enum):
    WAIT = "wait"
    PREEMPT_OTHER = "preempt another sequence"
    RECOMPUTE = "recompute (nothing to free)"
    RECOMPUTE_FREE = "free and recompute"
    ADMIT_ALONE = "admit the fork's children alone"
    TAKE_NODE_OUT = "take the node out of placement"
    LOG = "log it"
    RESEND = "resend the Step"
    FAIL_REQUEST = "fail the request"
    STOP_ENGINE = "stop the engine"


POLICY: dict[tuple[Item, type[BaseException]], Action] = {
    (Item.ADMISSION, OutOfBlocksError): Action.WAIT,
    (Item.ADMISSION, PoolGoneError): Action.WAIT,
    (Item.ADMISSION, PoolDrainingError): Action.WAIT,
    (Item.ADMISSION, Exception): Action.FAIL_REQUEST,
    (Item.APPEND, OutOfBlocksError): Action.PREEMPT_OTHER,
    (Item.APPEND, PendingWriteError): Action.WAIT,
    (Item.APPEND, PoolGoneError): Action.RECOMPUTE,
    (Item.APPEND, PoolDrainingError): Action.RECOMPUTE_FREE,
    (Item.APPEND, Exception): Action.FAIL_REQUEST,
    (Item.FORK, PoolGoneError): Action.RECOMPUTE,
    (Item.FORK, PoolDrainingError): Action.ADMIT_ALONE,
    (Item.FORK, OutOfBlocksError): Action.ADMIT_ALONE,
    (Item.FORK, Exception): Action.FAIL_REQUEST,
    (Item.SWAP_OUT, Exception): Action.RECOMPUTE_FREE,
    (Item.SWAP_IN, OutOfBlocksError): Action.WAIT,
    (Item.SWAP_IN, PendingWriteError): Action.WAIT,
    (Item.SWAP_IN, Exception): Action.RECOMPUTE,
    (Item.LATE_IDS, Exception): Action.LOG,
    (Item.HELD, EpochDropped): Action.RECOMPUTE,
    (Item.HELD, PoolGoneError): Action.RECOMPUTE,
    (Item.HELD, NodeOutOfPlacement): Action.RECOMPUTE_FREE,
    (Item.HELD, PoolReleasing): Action.RECOMPUTE_FREE,
    (Item.HELD, PoolLost): Action.RECOMPUTE,
    (Item.STEP, UnavailableError): Action.RESEND,
    (Item.STEP, DeadlineExceededError): Action.RESEND,
    (Item.STEP, Exception): Action.STOP_ENGINE,
    (Item.NODE_STEP, NodeUnreachable): Action.TAKE_NODE_OUT,
    (Item.NODE_STEP, NodeMovedOn): Action.RECOMPUTE_FREE,
    (Item.NODE_STEP, NodeRefused): Action.STOP_ENGINE,
    (Item.NODE_STEP, Exception): Action.STOP_ENGINE,
}

# What each row's action does to that item, in words (printed with the table in the docs).
ROW_NOTES: dict[tuple[Item, type[BaseException]], str] = {
    (Item.ADMISSION, OutOfBlocksError): "stays queued, tried again next step (NotPlaced: no room or budget)",
    (Item.ADMISSION, PoolGoneError): "stays queued; placed among the live pools next step",
    (Item.ADMISSION, PoolDrainingError): "stays queued; placed among the live pools next step",
    (Item.ADMISSION, Exception): "the request ends with the error (finish reason \"error\")",
    (Item.APPEND, OutOfBlocksError): "the most recently admitted idle sequence is preempted (swap or recompute)",
    (Item.APPEND, PendingWriteError): "its copy-on-write source is written in an unreported step: it sits this "
                                      "step out (nothing changed), tried again next step",
    (Item.APPEND, PoolGoneError): "re-queued; its blocks went with the node",
    (Item.APPEND, PoolDrainingError): "freed, re-queued, admitted elsewhere",
    (Item.APPEND, Exception): "the request ends with the error",
    (Item.FORK, PoolGoneError): "the parent re-queued, the children wait for its next fork",
    (Item.FORK, PoolDrainingError): "the parent goes on, the children are queued on their own",
    (Item.FORK, OutOfBlocksError): "the parent goes on, the children are queued on their own",
    (Item.FORK, Exception): "the request ends with the error",
    (Item.SWAP_OUT, Exception): "host tier full or absent: its device blocks freed, recomputed",
    (Item.SWAP_IN, OutOfBlocksError): "stays swapped, tried again next step",
    (Item.SWAP_IN, PendingWriteError): "its swap-out's step is unreported: stays swapped",
    (Item.SWAP_IN, Exception): "it cannot come back from host: recomputed",
    (Item.LATE_IDS, Exception): "a bug or a race with a drop: logged (the block went with its sequence)",
    (Item.HELD, EpochDropped): "its node's epoch ended (its step failed): recomputed, nothing to free",
    (Item.HELD, PoolGoneError): "swapped, and its pool is gone from the Step's answer: recomputed, nothing to free",
    (Item.HELD, NodeOutOfPlacement): "swapped on a node out of placement: freed, recomputed elsewhere",
    (Item.HELD, PoolReleasing): "running or swapped on a pool the fleet asks back (rebalance): freed, recomputed "
                                "on this engine's other nodes; the pool is reported released once nothing is left",
    (Item.HELD, PoolLost): "running or swapped on a pool handed to another fleet member (this engine missed its "
                           "heartbeats): the handover dropped it; recomputed, nothing to free",
    (Item.STEP, UnavailableError): "resent under its request id until answered, "
                                   "STOP_ENGINE after bm_unavailable_timeout_s",
    (Item.STEP, DeadlineExceededError): "resent under its request id until answered, "
                                        "STOP_ENGINE after bm_unavailable_timeout_s",
    (Item.STEP, Exception): "a Step the block manager refuses whole is a bug: its error is raised as it is",
    (Item.NODE_STEP, NodeUnreachable): "out of placement until a probe finds it back; its sequences recomputed",
    (Item.NODE_STEP, NodeMovedOn): "the step's sequences freed and re-queued "
                                   "(STOP_ENGINE after MAX_REFUSALS_IN_A_ROW = 20 in a row)",
    (Item.NODE_STEP, NodeRefused): "a misconfiguration or a bug (EngineFailure)",
    (Item.NODE_STEP, Exception): "a bug (EngineFailure)",
}


def failure_table() -> str:
    """The table as markdown, one row per `POLICY` entry (docs/architecture.md prints exactly
    this; `python -m engine.failure_policy` prints it)."""
    lines = ["| item | error | action | what happens |", "|---|---|---|---|"]
    for (item, cls), action in POLICY.items():
        error = "anything else" if cls is Exception else cls.__name__
        lines.append(f"| {item.value} | {error} | {action.name} | {ROW_NOTES[(item, cls)]} |")
    return "\n".join(lines)


def action_for(item: Item, error: BaseException) -> Action:
    """The table's action for `error` on `item` (the most specific class that has a row)."""
    for cls in type(error).__mro__:
        action = POLICY.get((item, cls))
        if action is not None:
            return action
    return Action.STOP_ENGINE


def errors_for(item: Item, action: Action) -> tuple[type[BaseException], ...]:
    """The error classes whose row on `item` is `action` (what an executor catches)."""
    return tuple(cls for (it, cls), act in POLICY.items() if it is item and act is action)


@dataclass(slots=True)
class NodeRefusals:
    """Steps each node refused in a row (moved on): past `MAX_REFUSALS_IN_A_ROW` the node is not
    recovering and its row's action becomes STOP_ENGINE. Counted on the engine thread, reset by
    a node's thread when it answers."""

    in_a_row: dict[str, int] = field(default_factory=dict)

    def action(self, node_id: str, error: BaseException) -> Action:
        action = action_for(Item.NODE_STEP, error)
        if isinstance(error, NodeMovedOn):
            count = self.in_a_row[node_id] = self.in_a_row.get(node_id, 0) + 1
            if count > MAX_REFUSALS_IN_A_ROW:
                return Action.STOP_ENGINE
        return action

    def answered(self, node_id: str) -> None:
        self.in_a_row[node_id] = 0


__all__ = ["MAX_REFUSALS_IN_A_ROW", "POLICY", "ROW_NOTES", "Action", "Item", "NodeRefusals", "action_for",
           "errors_for", "failure_table"]


if __name__ == "__main__":
    print(failure_table())
