"""What a store can refuse for one record's content, refused the same way on every backend and
before any I/O; and the request ids it still holds (`retained_requests`), which the service
indexes so that no retry is ever applied twice."""

from __future__ import annotations

import dataclasses

import pytest
from store_helpers import FakeClock, make_record

from block_manager.store import InvalidRecord, StoreOptions
from block_manager.store.records import MAX_DIGEST_LEN, MAX_REQUEST_ID_LEN, check_record_fields


@pytest.mark.parametrize(
    ("request_id", "op", "digest"),
    [
        ("x" * (MAX_REQUEST_ID_LEN + 1), "op", "d"),
        ("nul\0id", "op", "d"),
        ("id", "o" * 65, "d"),
        ("id", "op", "d" * (MAX_DIGEST_LEN + 1)),   # PostgreSQL's VARCHAR(64) refused it mid-commit
    ],
)
def test_record_fields_no_store_can_hold_are_refused(request_id: str, op: str, digest: str) -> None:
    with pytest.raises(InvalidRecord):
        check_record_fields(request_id, op, digest)


def test_a_refused_record_leaves_the_store_usable(store_url: str, opened) -> None:  # type: ignore[no-untyped-def]
    store = opened(store_url)
    bad = dataclasses.replace(make_record("bad"), payload_digest="d" * (MAX_DIGEST_LEN + 1))
    with pytest.raises(InvalidRecord):
        store.append([make_record("ok-1"), bad])
    assert store.append([make_record("ok-2")]) == [1]   # nothing of the refused batch, store fine
    assert [r.request_id for r in store.recover().records] == ["ok-2"]


def test_preencoded_payload_is_stored_verbatim(store_url: str, opened) -> None:  # type: ignore[no-untyped-def]
    store = opened(store_url)
    record = make_record("r")
    encoded = '{"requests":[]}'
    store.append([dataclasses.replace(record, payload_json=encoded)])
    assert store.lookup_request("r").payload == {"requests": []}


def test_retained_requests_are_every_id_the_journal_holds(store_url: str, opened) -> None:  # type: ignore[no-untyped-def]
    store = opened(store_url, StoreOptions(max_retained_requests=2, clock=FakeClock()))
    store.append([make_record(f"r{i}") for i in range(6)])
    store.write_snapshot(4, {"v": 4})   # prunes covered records beyond the newest 2: r0..r3
    retained = store.retained_requests()
    assert [(r.seq_no, r.request_id) for r in retained] == [(5, "r4"), (6, "r5")]
    assert retained[0].payload_digest == make_record("r4").payload_digest
    store.write_snapshot(6, {"v": 6})
    assert [r.request_id for r in store.retained_requests()] == ["r4", "r5"]   # the newest 2 stay
