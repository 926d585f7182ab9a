"""What the engine does when part of a step fails: one table, (item kind x typed error) -> action.

Every failure the engine handles arrives as a typed error: the block manager's per-item
refusals (`block_manager.client`: out of blocks, pool gone, pool draining, invalid) and a
model node's failed step (`engine.errors`: unreachable, moved on, refused). `action_for` looks
the pair up, walking the error's class hierarchy, so a subclass inherits its parent's row.

| item      | error                      | action                                                        |
|-----------|----------------------------|---------------------------------------------------------------|
| admission | OutOfBlocks                | WAIT: stays queued, tried again next step                     |
| admission | PoolGone, PoolDraining     | WAIT: that node leaves the routes; placed elsewhere            |
| admission | anything else              | FAIL_REQUEST: the request ends with the error (finish "error") |
| append    | OutOfBlocks                | PREEMPT_OTHER: the most recently admitted idle sequence frees |
| append    | PoolGone                   | RECOMPUTE: re-queued; its blocks went with the node           |
| append    | PoolDraining               | RECOMPUTE_FREE: freed, re-queued, admitted elsewhere           |
| append    | anything else              | FAIL_REQUEST                                                  |
| fork      | PoolGone                   | RECOMPUTE: the parent re-queued, the children wait for it     |
| fork      | PoolDraining, OutOfBlocks  | ADMIT_ALONE: the parent goes on, the children queue alone     |
| fork      | anything else              | FAIL_REQUEST                                                  |
| node step | NodeUnreachable            | TAKE_NODE_OUT: out of placement, its sequences recomputed     |
| node step | NodeMovedOn                | RECOMPUTE_FREE: the step's sequences freed and re-queued      |
| node step | NodeRefused, anything else | STOP_ENGINE: a misconfiguration or a bug (EngineFailure)      |

A node that moves on `MAX_REFUSALS_IN_A_ROW` steps in a row is not recovering: STOP_ENGINE.
"""

from __future__ import annotations

from enum import Enum

from block_manager.client import OutOfBlocksError, PoolDrainingError, PoolGoneError
from engine.errors import NodeMovedOn, NodeRefused, NodeUnreachable

MAX_REFUSALS_IN_A_ROW = 20


class Item(Enum):
    ADMISSION = "admission"
    APPEND = "append"
    FORK = "fork"
    NODE_STEP = "node step"


class Action(Enum):
    WAIT = "wait"
    PREEMPT_OTHER = "preempt another sequence"
    RECOMPUTE = "recompute (nothing to free)"
    RECOMPUTE_FREE = "free and recompute"
    ADMIT_ALONE = "admit the fork's children alone"
    TAKE_NODE_OUT = "take the node out of placement"
    FAIL_REQUEST = "fail the request"
    STOP_ENGINE = "stop the engine"


POLICY: dict[tuple[Item, type[BaseException]], Action] = {
    (Item.ADMISSION, OutOfBlocksError): Action.WAIT,
    (Item.ADMISSION, PoolGoneError): Action.WAIT,
    (Item.ADMISSION, PoolDrainingError): Action.WAIT,
    (Item.ADMISSION, Exception): Action.FAIL_REQUEST,
    (Item.APPEND, OutOfBlocksError): Action.PREEMPT_OTHER,
    (Item.APPEND, PoolGoneError): Action.RECOMPUTE,
    (Item.APPEND, PoolDrainingError): Action.RECOMPUTE_FREE,
    (Item.APPEND, Exception): Action.FAIL_REQUEST,
    (Item.FORK, PoolGoneError): Action.RECOMPUTE,
    (Item.FORK, PoolDrainingError): Action.ADMIT_ALONE,
    (Item.FORK, OutOfBlocksError): Action.ADMIT_ALONE,
    (Item.FORK, Exception): Action.FAIL_REQUEST,
    (Item.NODE_STEP, NodeUnreachable): Action.TAKE_NODE_OUT,
    (Item.NODE_STEP, NodeMovedOn): Action.RECOMPUTE_FREE,
    (Item.NODE_STEP, NodeRefused): Action.STOP_ENGINE,
    (Item.NODE_STEP, Exception): Action.STOP_ENGINE,
}


def action_for(item: Item, error: BaseException) -> Action:
    """The table's action for `error` on `item` (the most specific class that has a row)."""
    for cls in type(error).__mro__:
        action = POLICY.get((item, cls))
        if action is not None:
            return action
    return Action.STOP_ENGINE


__all__ = ["MAX_REFUSALS_IN_A_ROW", "POLICY", "Action", "Item", "action_for"]
