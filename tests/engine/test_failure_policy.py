"""The failure table and the sequence lifecycle, read as tables (issue 21)."""

from __future__ import annotations

import pytest

from block_manager.client import (
    InvalidArgumentError,
    NotFoundError,
    OutOfBlocksError,
    PoolDrainingError,
    PoolGoneError,
)
from block_manager.client.errors import error_for
from engine.errors import NodeMovedOn, NodeRefused, NodeUnreachable
from engine.executor import node_error
from engine.failure_policy import Action, Item, action_for
from engine.params import SamplingParams
from engine.sequence import TRANSITIONS, LifecycleError, Request, SeqStatus, Sequence


@pytest.mark.parametrize(("item", "error", "action"), [
    (Item.ADMISSION, OutOfBlocksError("full"), Action.WAIT),
    (Item.ADMISSION, PoolGoneError("fenced"), Action.WAIT),
    (Item.ADMISSION, PoolDrainingError("draining"), Action.WAIT),
    (Item.ADMISSION, InvalidArgumentError("too long"), Action.FAIL_REQUEST),
    (Item.APPEND, OutOfBlocksError("full"), Action.PREEMPT_OTHER),
    (Item.APPEND, PoolGoneError("fenced"), Action.RECOMPUTE),
    (Item.APPEND, PoolDrainingError("draining"), Action.RECOMPUTE_FREE),
    (Item.APPEND, NotFoundError("no such sequence"), Action.FAIL_REQUEST),
    (Item.FORK, PoolGoneError("fenced"), Action.RECOMPUTE),
    (Item.FORK, PoolDrainingError("draining"), Action.ADMIT_ALONE),
    (Item.FORK, OutOfBlocksError("full"), Action.ADMIT_ALONE),
    (Item.NODE_STEP, NodeUnreachable("n", "gone"), Action.TAKE_NODE_OUT),
    (Item.NODE_STEP, NodeMovedOn("n", "new epoch"), Action.RECOMPUTE_FREE),
    (Item.NODE_STEP, NodeRefused("n", "no credentials"), Action.STOP_ENGINE),
    (Item.NODE_STEP, RuntimeError("bug"), Action.STOP_ENGINE),
])
def test_the_failure_table(item: Item, error: Exception, action: Action) -> None:
    assert action_for(item, error) is action


def test_block_manager_refusals_are_typed_by_reason_not_compared_as_strings() -> None:
    import grpc

    for reason in ("NodeFenced", "StaleEpoch", "UnknownPool"):
        err = error_for(grpc.StatusCode.FAILED_PRECONDITION, "x", reason=reason)
        assert isinstance(err, PoolGoneError) and err.code is grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(error_for(grpc.StatusCode.FAILED_PRECONDITION, "x", reason="PoolDraining"), PoolDrainingError)
    assert type(error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", reason="OutOfBlocks")) is OutOfBlocksError


def test_node_status_codes_become_typed_node_errors() -> None:
    import grpc

    assert isinstance(node_error("n", grpc.StatusCode.UNAVAILABLE, ""), NodeUnreachable)
    assert isinstance(node_error("n", grpc.StatusCode.DEADLINE_EXCEEDED, ""), NodeUnreachable)
    assert isinstance(node_error("n", grpc.StatusCode.CANCELLED, ""), NodeUnreachable)   # it stopped mid-call
    for code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
        assert isinstance(node_error("n", code, ""), NodeMovedOn)
    for code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT, None):
        assert isinstance(node_error("n", code, ""), NodeRefused)


def _seq() -> Sequence:
    return Sequence(Request("r", None, [1, 2, 3], SamplingParams()), 0, [1, 2, 3], 3, None)


def test_the_lifecycle_moves_only_along_its_transitions() -> None:
    seq = _seq()
    assert seq.status is SeqStatus.WAITING and seq.seq_id is None
    seq.admit("r/0/0", "node-0", 2)
    assert (seq.status, seq.seq_id, seq.node_id, seq.num_computed) == (SeqStatus.RUNNING, "r/0/0", "node-0", 2)
    seq.token_ids.append(9)
    assert seq.preempt() == "r/0/0"
    assert (seq.status, seq.seq_id, seq.node_id, seq.num_prompt) == (SeqStatus.PREEMPTED, None, None, 4)
    with pytest.raises(LifecycleError):
        seq.preempt()                # not running
    with pytest.raises(LifecycleError):
        seq.detach()                 # only a fork child detaches
    seq.admit("r/0/1", "node-1", 0)
    assert seq.finish() == "r/0/1" and seq.status is SeqStatus.FINISHED
    for move in (lambda: seq.admit("r/0/2", "n", 0), seq.preempt, seq.finish):
        with pytest.raises(LifecycleError):
            move()
    assert TRANSITIONS[SeqStatus.FINISHED] == frozenset()


def test_a_refused_request_ends_with_its_error_and_the_engine_goes_on() -> None:
    """FAIL_REQUEST: the request's completions end with finish reason "error" and the reason in
    its output; nothing is held; the other requests are served."""
    from tests.engine.fakes import fake_completion, fake_engine

    engine, _ = fake_engine(1, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = engine.add_request([1, 2, 3, 4, 5], SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True))
    good = engine.add_request([6, 7, 8], params)
    engine.step()                                       # both admitted (the n=2 parent prefills)
    engine._act(Item.APPEND, InvalidArgumentError("no such thing"), engine.requests[bad])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[bad].error is not None and "no such thing" in done[bad].error
    assert [c.finish_reason for c in done[bad].outputs] == ["error", "error"]
    assert done[good].error is None and done[good].outputs[0].token_ids == fake_completion([6, 7, 8], 4)
    engine.flush()
    assert engine.client.state.core.sequences() == [] and engine.client.state.core.fsck() == []
