"""The failure table and the sequence lifecycle, read as tables (issues 21, 47), and the docs'
copies of both checked against the code."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from block_manager.client import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    OutOfBlocksError,
    PendingWriteError,
    PoolDrainingError,
    PoolGoneError,
    UnavailableError,
)
from block_manager.client.errors import error_for
from engine.bm_steps import UNREACHABLE
from engine.errors import EpochDropped, NodeMovedOn, NodeOutOfPlacement, NodeRefused, NodeUnreachable
from engine.executor import node_error
from engine.failure_policy import (
    MAX_REFUSALS_IN_A_ROW,
    POLICY,
    ROW_NOTES,
    Action,
    Item,
    NodeRefusals,
    action_for,
    failure_table,
)
from engine.params import SamplingParams
from engine.sequence import TRANSITIONS, LifecycleError, Request, SeqStatus, Sequence

ROOT = Path(__file__).resolve().parents[2]
PENDING_WRITE = error_for(grpc.StatusCode.FAILED_PRECONDITION, "swap-out unreported", reason="PendingWrite")


@pytest.mark.parametrize(("item", "error", "action"), [
    (Item.ADMISSION, OutOfBlocksError("full"), Action.WAIT),
    (Item.ADMISSION, PoolGoneError("fenced"), Action.WAIT),
    (Item.ADMISSION, PoolDrainingError("draining"), Action.WAIT),
    (Item.ADMISSION, InvalidArgumentError("too long"), Action.FAIL_REQUEST),
    (Item.APPEND, OutOfBlocksError("full"), Action.PREEMPT_OTHER),
    (Item.APPEND, PENDING_WRITE, Action.WAIT),
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
    (Item.SWAP_OUT, OutOfBlocksError("host full"), Action.RECOMPUTE_FREE),
    (Item.SWAP_OUT, InvalidArgumentError("no host tier"), Action.RECOMPUTE_FREE),
    (Item.SWAP_IN, OutOfBlocksError("full"), Action.WAIT),
    (Item.SWAP_IN, PENDING_WRITE, Action.WAIT),
    (Item.SWAP_IN, PoolDrainingError("draining"), Action.RECOMPUTE),
    (Item.SWAP_IN, NotFoundError("swap lost"), Action.RECOMPUTE),
    (Item.LATE_IDS, NotFoundError("dropped"), Action.LOG),
    (Item.HELD, EpochDropped("r/0/0"), Action.RECOMPUTE),
    (Item.HELD, PoolGoneError("gone from the answer"), Action.RECOMPUTE),
    (Item.HELD, NodeOutOfPlacement("n"), Action.RECOMPUTE_FREE),
    (Item.STEP, UnavailableError("restarting"), Action.RESEND),
    (Item.STEP, CancelledError("stopped mid-call"), Action.RESEND),
    (Item.STEP, DeadlineExceededError("slow"), Action.RESEND),
    (Item.STEP, InvalidArgumentError("malformed"), Action.STOP_ENGINE),
])
def test_the_failure_table(item: Item, error: Exception, action: Action) -> None:
    assert action_for(item, error) is action


def test_block_manager_refusals_are_typed_by_reason_not_compared_as_strings() -> None:
    assert type(PENDING_WRITE) is PendingWriteError
    for reason in ("NodeFenced", "StaleEpoch", "UnknownPool"):
        err = error_for(grpc.StatusCode.FAILED_PRECONDITION, "x", reason=reason)
        assert isinstance(err, PoolGoneError) and err.code is grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(error_for(grpc.StatusCode.FAILED_PRECONDITION, "x", reason="PoolDraining"), PoolDrainingError)
    assert type(error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", reason="OutOfBlocks")) is OutOfBlocksError


def test_the_engine_compares_no_reason_string_and_coalesces_no_id() -> None:
    """Decisions go by the error's class (the table), and "running => admitted" is a type
    (`seq.admitted`), so no `.reason` is read and no id is coalesced to "" in the engine."""
    for path in sorted((ROOT / "engine").rglob("*.py")):
        text = path.read_text()
        assert ".reason" not in text, path
        assert not re.search(r"(seq_id|node_id) or \"\"", text), path


def test_the_step_sender_resends_exactly_the_resend_rows() -> None:
    assert set(UNREACHABLE) == {cls for (item, cls), act in POLICY.items()
                                if item is Item.STEP and act is Action.RESEND}


def test_a_node_that_keeps_moving_on_stops_the_engine() -> None:
    refusals = NodeRefusals()
    moved = NodeMovedOn("n", "new epoch")
    assert all(refusals.action("n", moved) is Action.RECOMPUTE_FREE for _ in range(MAX_REFUSALS_IN_A_ROW))
    assert refusals.action("n", moved) is Action.STOP_ENGINE
    refusals.answered("n")
    assert refusals.action("n", moved) is Action.RECOMPUTE_FREE
    assert refusals.action("m", NodeUnreachable("m", "gone")) is Action.TAKE_NODE_OUT


def _doc_section(title: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def test_the_docs_failure_table_is_the_codes() -> None:
    """docs/architecture.md prints `POLICY` as `failure_table()` renders it, row for row (fix:
    paste `python -m engine.failure_policy`'s output over the docs' table)."""
    assert set(ROW_NOTES) == set(POLICY)
    section = _doc_section("## The engine: a sequence's lifecycle and the failure table")
    docs_rows = [line for line in section.splitlines() if line.startswith("|")]
    assert docs_rows == failure_table().splitlines()


def test_the_docs_lifecycle_diagram_is_transitions() -> None:
    """Every arrow of the docs' lifecycle diagram is a transition and every transition is drawn
    (the finishes by the diagram's "any state but FINISHED may finish")."""
    section = _doc_section("## The engine: a sequence's lifecycle and the failure table")
    diagram = section.split("```")[1]
    drawn = {(SeqStatus[a], SeqStatus[b])
             for a, b in re.findall(r"([A-Z]+) ──(?:(?!──>).)*──> (?=([A-Z]+))", diagram)}
    assert "any state but FINISHED may finish" in diagram
    drawn |= {(s, SeqStatus.FINISHED) for s in SeqStatus if s is not SeqStatus.FINISHED}
    assert drawn == {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


def test_node_status_codes_become_typed_node_errors() -> None:
    assert isinstance(node_error("n", grpc.StatusCode.UNAVAILABLE, ""), NodeUnreachable)
    assert isinstance(node_error("n", grpc.StatusCode.DEADLINE_EXCEEDED, ""), NodeUnreachable)
    assert isinstance(node_error("n", grpc.StatusCode.CANCELLED, ""), NodeUnreachable)   # it stopped mid-call
    for code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
        assert isinstance(node_error("n", code, ""), NodeMovedOn)
    for code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT, None):
        assert isinstance(node_error("n", code, ""), NodeRefused)


def _seq() -> Sequence:
    return Sequence(Request("r", None, [1, 2, 3], SamplingParams()), 0, [1, 2, 3], 3, None)


def test_only_an_admitted_sequence_has_an_admission() -> None:
    seq = _seq()
    with pytest.raises(LifecycleError):
        _ = seq.admitted             # WAITING: holds nothing
    seq.admit("r/0/0", "node-0", 0)
    assert (seq.admitted.seq_id, seq.admitted.node_id) == ("r/0/0", "node-0")
    seq.swap_out()
    assert seq.admitted.seq_id == "r/0/0"   # SWAPPED keeps it
    seq.preempt()
    with pytest.raises(LifecycleError):
        _ = seq.admitted


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
    engine.scheduler.refuse(Item.APPEND, InvalidArgumentError("no such thing"), engine.requests[bad].seqs[0])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[bad].error is not None and "no such thing" in done[bad].error
    assert [c.finish_reason for c in done[bad].outputs] == ["error", "error"]
    assert done[good].error is None and done[good].outputs[0].token_ids == fake_completion([6, 7, 8], 4)
    engine.flush()
    assert engine.client.state.core.sequences() == [] and engine.client.state.core.fsck() == []
