"""The Step's typed codec (`step_codec.StepInput`, `step_answer.StepAnswer`): its journal forms
are frozen, byte for byte (the JSON one written before version 1, which old journals hold, and
the packed `step-request/1` one), and its protobuf form carries every named field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from block_manager.core.errors import InvalidRequest
from block_manager.service.protocol import request_digest
from block_manager.service.servicer import step_response
from block_manager.service.state import ServiceState, StateConfig
from block_manager.service.step_answer import ItemError, PoolFree, SettledPool, StepAnswer
from block_manager.service.step_codec import (
    STEP_ANSWER_FORMAT,
    STEP_REQUEST_FORMAT,
    ReceivedStep,
    StepInput,
    step_payload,
)
from block_manager.store.records import Packed, canonical_json, encode_body
from pagedkv.tiers import TierKind
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.step_scenario import SCENARIO, full_request

GOLDEN = Path(__file__).parent / "golden"


def _run() -> list[str]:
    s = ServiceState(StateConfig(default_block_size=4, max_blocks=64))
    lines = []
    for op, p in SCENARIO:
        try:
            r = s.apply(op, json.loads(json.dumps(p)), 1.0)
            lines.append(canonical_json({"op": op, "mutated": r.mutated, "result": r.result}))
        except Exception as exc:  # noqa: BLE001 - the refusal's class is part of the record
            lines.append(canonical_json({"op": op, "error": type(exc).__name__}))
    return lines


def _golden_answers() -> list[dict]:
    records = [json.loads(line) for line in (GOLDEN / "step_journal.jsonl").read_text().splitlines()]
    return [r["result"] for r in records if r["op"] == "step" and "result" in r]


def test_a_run_journals_byte_for_byte_what_it_always_did() -> None:
    assert _run() == (GOLDEN / "step_journal.jsonl").read_text().splitlines()


def test_the_request_payload_is_the_journal_form_it_always_was() -> None:
    payload = step_payload(full_request())
    assert canonical_json(payload) == (GOLDEN / "step_payload.json").read_text().strip()
    step = StepInput.from_json(json.loads(canonical_json(payload)), max_batch=16)
    assert (step.swap_out, step.swap_in, step.swap_ids, step.release) == (["o"], ["i"], ["o", "i"], True)
    assert [(a.seq_id, a.place, a.salt, a.num_tokens) for a in step.allocs] == [("a", False, "x", None),
                                                                               ("b", True, None, 3)]
    assert (step.placement.pool_ids, step.placement.admit_budget) == (["n1"], 7)
    assert step.num_items == 2 + 1 + 1 + 2 + 1   # allocs, written, forks, appends, late ids
    assert step.appends.num_late == [0, 1] and step.forks == [("p", ["p1", "p2"])]


def test_answers_round_trip_and_fill_the_response_by_name() -> None:
    answers = _golden_answers()
    assert answers
    for r in answers:
        assert StepAnswer.from_json(r).to_json() == r
    swapped = StepAnswer.from_json(next(r for r in answers if "swapped_in" in r))
    resp = swapped.fill(pb.StepResponse())
    assert list(resp.swapped_in_seq_ids) == [s for s, _ in swapped.swapped_in]
    assert list(resp.swapped_in_num_tokens) == [n for _, n in swapped.swapped_in]
    assert [TierKind(k) for k in resp.steps[0].tier_kind] == [TierKind.SWAP_IN] * 3
    assert [(f.pool_id, f.host_usable_blocks) for f in resp.pool_free] == [
        (f.pool_id, f.host_usable_blocks or 0) for f in swapped.pool_free]
    failed = StepAnswer.from_json(next(r for r in answers if r["errors"]))
    assert failed.errors == [ItemError("append", 1, "UnknownSequence", "unknown sequence 'zz'")]
    e = failed.fill(pb.StepResponse()).errors[0]
    assert (e.section, e.index, e.reason, e.code) == ("append", 1, "UnknownSequence", 5)   # NOT_FOUND


def test_an_answer_journaled_by_an_older_server_is_still_served() -> None:
    old = {"steps": [], "settled": [["n1", 3, [7], [], ["x"]]], "errors": [], "alloc_num_cached_tokens": [0],
           "alloc_num_tokens": [4], "append_num_tokens": [], "lease_epochs": {"n1": 2}}
    answer = StepAnswer.from_json(old)
    assert answer.settled == [SettledPool("n1", 3, [7], [], ["x"])]
    assert (answer.pool_free, answer.alloc_pool_ids, answer.swapped_out) == ([], [], [])
    resp = answer.fill(pb.StepResponse())
    assert (resp.settled[0].settled_step, list(resp.settled[0].committed_plan_ids)) == (3, [7])
    assert not resp.pool_free and not resp.alloc_pool_ids and dict(resp.lease_epochs) == {"n1": 2}


@pytest.mark.parametrize("row", [["n1", 3, 5], ["n1", 3, 5, 0], ["n1", 3, 5, 9]])
def test_pool_room_keeps_its_host_column_only_for_a_pool_with_a_host_tier(row: list) -> None:
    free = PoolFree.from_json(row)
    assert free.to_json() == row
    assert free.host_usable_blocks == (row[3] if len(row) > 3 else None)


# ---- the binary journal forms (version 1) ---------------------------------------------------
def test_the_packed_request_is_the_digested_body_after_a_flags_byte() -> None:
    """The journal's `step-request/1` text of a full request is frozen (golden), holds no
    request id and no session, and its body is exactly what the request digest is taken over."""
    req = full_request()
    req.session.session_id, req.session.seq, req.session.acked = "b" * 32, 4, 3
    received = ReceivedStep(req)
    text = encode_body(received.journal_form())
    assert text == (GOLDEN / "step_request_v1.txt").read_text().strip()
    packed = Packed.from_text(text)
    assert packed.format == STEP_REQUEST_FORMAT == "step-request/1"
    assert packed.data[0] == 0 and b"r1" not in packed.data and b"b" * 32 not in packed.data
    assert received.digest() == request_digest("Step", req)
    assert ReceivedStep(req, fleet=True).journal_form().data[0] == 1
    assert req.request_id == "r1" and req.session.seq == 4   # the request itself is left whole


def test_a_recorded_answer_is_the_response_bytes_and_serves_byte_for_byte() -> None:
    answers = [StepAnswer.from_json(r) for r in _golden_answers()]
    for answer in answers:
        received = ReceivedStep(full_request(), new_response=pb.StepResponse)
        recorded = received.record(answer)
        assert isinstance(recorded, Packed) and recorded.format == STEP_ANSWER_FORMAT
        assert received.response == answer.fill(pb.StepResponse())
        stored = Packed.from_text(encode_body(recorded))
        assert step_response(stored) == received.response == step_response(answer.to_json())
    assert ReceivedStep(full_request()).record(answers[0]) == answers[0].to_json()   # no transport: JSON


@pytest.mark.parametrize("packed, message", [
    (Packed("step-request/2", b"\0"), "not a packed step request"),
    (Packed(STEP_REQUEST_FORMAT, b""), "not a packed step request"),
    (Packed(STEP_REQUEST_FORMAT, b"\x02"), "unknown flags"),
])
def test_a_packed_request_of_another_version_is_refused(packed: Packed, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        ReceivedStep.from_packed(packed, pb.StepRequest.FromString)
