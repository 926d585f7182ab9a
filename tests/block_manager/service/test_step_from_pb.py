"""`StepInput.from_pb` (the live Step path: the request decoded straight from the message) gives
the same value, or the same refusal with the same message, as the journal path
`StepInput.from_json(step_payload(request))` that replay uses, on well-formed and malformed
requests alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager.core.errors import InvalidRequest
from block_manager.core.leases import check_scheduler_id
from block_manager.service.step_codec import ReceivedStep, StepInput
from block_manager.store.records import Packed, canonical_json, encode_body
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.step_scenario import full_request

MAX_BATCH = 3   # below the drawn columns of 5: the size limits are exercised too

BAD_IDS = ["", "x" * 300]


@st.composite
def requests(draw: st.DrawFn) -> pb.StepRequest:
    """Well-formed Step requests of every section, then at most one column replaced by a
    drawn (mostly malformed) one: both decoders must agree on each."""
    n = draw(st.integers(0, 3))
    seqs = [f"s{i}" for i in range(n)]
    counts = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    with_ids = draw(st.booleans())
    tokens = [7] * sum(counts) if with_ids else []
    k = draw(st.integers(0, 3))
    alloc_ids = [f"a{i}" for i in range(k)]
    given_ids = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    place = draw(st.sampled_from([[], [True] * k, [False] * k]))
    req = pb.StepRequest(
        scheduler_id="s",
        pool_epochs=draw(st.dictionaries(st.sampled_from(["n1", "n2"]), st.integers(0, 3), max_size=2)),
        free_seq_ids=draw(st.lists(st.sampled_from(["f1", "f2"]), max_size=2, unique=True)),
        alloc_seq_ids=alloc_ids, pool_ids=["n1", "n2"], salts=["x"],
        alloc_pool_index=draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)),
        alloc_salt_index=draw(st.lists(st.integers(-1, 0), min_size=k, max_size=k)),
        alloc_num_token_ids=[3 if g else 0 for g in given_ids], alloc_token_ids=[1] * (3 * sum(given_ids)),
        alloc_num_tokens=[0 if g else 5 for g in given_ids],
        alloc_num_compute=draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)),
        alloc_place=place, place_pool_ids=["n1"] if place else [], admit_budget=draw(st.integers(0, 3)),
        written_seq_ids=seqs[:1], written_num_tokens=counts[:1], written_token_ids=tokens[: counts[0]] if n else [],
        fork_parent_ids=["p"] if draw(st.booleans()) else [], fork_num_children=[2], fork_child_ids=["c1", "c2"],
        append_seq_ids=seqs, append_num_tokens=counts, append_token_ids=tokens,
        append_num_late=draw(st.sampled_from([[], [0] * n, [1] * n])), release_leases=draw(st.booleans()),
        swap_out_seq_ids=draw(st.lists(st.sampled_from(["o1", "o2"]), max_size=2, unique=True)),
        swap_in_seq_ids=draw(st.lists(st.sampled_from(["i1", "i2"]), max_size=2, unique=True)),
        late_seq_ids=seqs[:1], late_num_tokens=counts[:1], late_token_ids=[9] * counts[0] if n else [],
    )
    if not req.fork_parent_ids:
        req.ClearField("fork_num_children")
        req.ClearField("fork_child_ids")
    for pool in draw(st.lists(st.sampled_from(["n1", "n2"]), max_size=2, unique=True)):
        req.reports.add(pool_id=pool, epoch=draw(st.integers(0, 2)), completed_up_to=draw(st.integers(0, 3)),
                        failed_from=draw(st.integers(0, 4)))
    name = draw(st.sampled_from([None, *(f.name for f in pb.StepRequest.DESCRIPTOR.fields
                                         if f.name not in ("request_id", "session", "pool_epochs"))]))
    if name is None:
        return req
    desc = pb.StepRequest.DESCRIPTOR.fields_by_name[name]
    msg = cast(Any, req)   # the field is named at run time
    msg.ClearField(name)
    col: list[Any]
    if desc.type == desc.TYPE_MESSAGE:   # reports
        for pool in draw(st.lists(st.sampled_from(["n1", "n1", *BAD_IDS]), max_size=3)):
            req.reports.add(pool_id=pool, completed_up_to=1)
        return req
    if desc.type == desc.TYPE_STRING:
        col = draw(st.lists(st.sampled_from(["a", "b", "s1", "n1", *BAD_IDS]), max_size=5))
    elif desc.type == desc.TYPE_BOOL:
        col = draw(st.lists(st.booleans(), max_size=5))
    else:
        col = draw(st.lists(st.integers(-2 if desc.type == desc.TYPE_INT32 else 0, 4), max_size=6))
    if desc.is_repeated:
        getattr(msg, name).extend(col)
    elif col:
        setattr(msg, name, col[0])
    return req


Outcome = tuple[str, Any]   # ("ok", the StepInput) or ("refused", the message)


def _outcome(decode: Callable[[], StepInput]) -> Outcome:
    try:
        return ("ok", decode())
    except InvalidRequest as exc:
        return ("refused", str(exc))


def _both(req: pb.StepRequest, fleet: bool = False) -> tuple[Outcome, Outcome]:
    received = ReceivedStep(req, fleet=fleet)
    journaled = json.loads(canonical_json(received.payload()))   # as replay reads it back

    def from_json() -> StepInput:
        check_scheduler_id(journaled.get("scheduler_id"))   # as `ServiceState._step` checks first
        return StepInput.from_json(journaled, MAX_BATCH)

    return _outcome(lambda: received.decode(MAX_BATCH)), _outcome(from_json)


@settings(max_examples=600, deadline=None)
@given(requests(), st.booleans())
def test_from_pb_decodes_or_refuses_as_the_journal_path_does(req: pb.StepRequest, fleet: bool) -> None:
    live, replayed = _both(req, fleet)
    assert live == replayed


def test_a_full_request_decodes_the_same_both_ways() -> None:
    live, replayed = _both(full_request())
    assert live[0] == "ok" and live == replayed
    live, replayed = _both(full_request(), fleet=True)
    assert live == replayed and live[1].fleet


@pytest.mark.parametrize("field, value, message", [
    ("append_num_tokens", [0, 1], "append_num_tokens must hold integers >= 1"),
    ("alloc_salt_index", [0, 1], "salt index 1 out of range"),
    ("fork_num_children", [3], "fork columns disagree"),
    ("late_token_ids", [], "late: no token ids"),
])
def test_malformed_columns_are_refused_with_the_journal_paths_message(field: str, value: list, message: str) -> None:
    req = full_request()
    cast(Any, req).ClearField(field)
    getattr(req, field).extend(value)
    live, replayed = _both(req)
    assert live == replayed and live[0] == "refused" and message in live[1]


def test_a_section_without_ids_is_ignored_as_its_payload_drops_it() -> None:
    req = pb.StepRequest(scheduler_id="s", written_num_tokens=[0], append_num_late=[3], place_pool_ids=[""],
                         admit_budget=3, pool_ids=[""], fork_num_children=[9])
    live, replayed = _both(req)
    assert live == replayed and live[0] == "ok"


@settings(max_examples=300, deadline=None)
@given(requests(), st.booleans())
def test_the_packed_journal_form_replays_as_the_live_request_decodes(req: pb.StepRequest, fleet: bool) -> None:
    """Since `step-request/1` a Step is journaled as its request's bytes: read back through the
    stored text, they decode (or are refused) exactly as the live message did."""
    req.request_id = "r1"
    req.session.session_id, req.session.seq, req.session.acked = "a" * 32, 3, 2
    live = ReceivedStep(req, fleet=fleet)
    stored = Packed.from_text(encode_body(live.journal_form()))
    replayed = ReceivedStep.from_packed(stored, pb.StepRequest.FromString)
    assert replayed.fleet == fleet
    assert _outcome(lambda: replayed.decode(MAX_BATCH)) == _outcome(lambda: live.decode(MAX_BATCH))
    assert replayed.digest() == live.digest()
