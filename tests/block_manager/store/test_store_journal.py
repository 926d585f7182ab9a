"""Journal, snapshot and idempotency semantics, the same on every backend."""

from __future__ import annotations

import random
import threading

import pytest
from store_helpers import FakeClock, make_record

from block_manager.store import (
    DuplicateRequestId,
    InvalidRecord,
    InvalidSnapshot,
    NewRecord,
    Packed,
    Recovered,
    StoreError,
    StoreOptions,
    canonical_json,
    payload_digest,
)
from block_manager.store.records import decode_body


def test_empty_store_recovers_nothing(store_url: str, opened) -> None:
    store = opened(store_url)
    assert store.recover() == Recovered(None, 0, [])
    assert store.last_seq_no == 0
    assert store.lookup_request("nope") is None
    assert store.stats().backend == store.backend == store_url.split(":")[0].split("+")[0]


def test_append_assigns_increasing_seq_nos_and_recovers_in_order(store_url: str, opened) -> None:
    store = opened(store_url)
    batches = [[make_record(f"b{b}-r{i}") for i in range(n)] for b, n in enumerate([1, 3, 5])]
    assigned = [store.append(batch) for batch in batches]
    assert assigned == [[1], [2, 3, 4], [5, 6, 7, 8, 9]]
    assert store.append([]) == []
    recovered = store.recover()
    assert recovered.snapshot is None and recovered.snapshot_seq_no == 0
    flat = [rec for batch in batches for rec in batch]
    assert [r.seq_no for r in recovered.records] == list(range(1, 10))
    for got, want in zip(recovered.records, flat, strict=True):
        assert (got.request_id, got.op, got.payload_digest) == (
            want.request_id, want.op, want.payload_digest,
        )
        assert got.payload == want.payload
        # Tuples come back as lists on every backend: results are JSON.
        assert got.result["results"][1]["slot_mapping"] == [16]


def test_reopen_continues_seq_nos_and_keeps_everything(durable_url: str, opened) -> None:
    store = opened(durable_url)
    store.append([make_record("a"), make_record("b")])
    store.write_snapshot(1, {"pools": {"n0": [1, 2]}})
    store.close()
    store = opened(durable_url)
    assert store.last_seq_no == 2
    assert store.append([make_record("c")]) == [3]
    recovered = store.recover()
    assert recovered.snapshot == {"pools": {"n0": [1, 2]}}
    assert recovered.snapshot_seq_no == 1
    assert [r.request_id for r in recovered.records] == ["b", "c"]


def test_snapshot_replaces_older_and_prunes_covered_records(store_url: str, opened) -> None:
    clock = FakeClock()
    store = opened(store_url, StoreOptions(max_retained_requests=2, clock=clock))
    store.append([make_record(f"r{i}") for i in range(6)])
    store.write_snapshot(3, {"v": 3})
    recovered = store.recover()
    assert recovered.snapshot == {"v": 3} and recovered.snapshot_seq_no == 3
    assert [r.seq_no for r in recovered.records] == [4, 5, 6]
    # Covered records beyond the newest 2 (seq_no <= 6 - 2) are pruned...
    assert store.lookup_request("r0") is None
    assert store.lookup_request("r2") is None
    # ...those not covered by the snapshot stay whatever their age.
    assert store.lookup_request("r3").seq_no == 4
    store.write_snapshot(6, {"v": 6})
    assert store.recover() == Recovered({"v": 6}, 6, [])
    # The newest two stay answerable for retries though the snapshot covers them.
    assert [store.lookup_request(f"r{i}") is not None for i in range(6)] == [False] * 4 + [True] * 2
    assert store.stats().num_journal_records == 2


def test_retry_after_snapshot_is_answered_within_the_time_window(store_url: str, opened) -> None:
    clock = FakeClock(1_000.0)
    store = opened(store_url, StoreOptions(request_retention_s=60.0, clock=clock))
    record = make_record("req-1", num_seqs=4)
    store.append([record])
    clock.now += 30
    store.append([make_record("req-2")])
    store.write_snapshot(2, {"v": 2})
    found = store.lookup_request("req-1")
    assert found is not None
    assert found.result["results"][3]["slot_mapping"] == [48]
    assert found.payload_digest == payload_digest(record.payload)
    # Still no re-use of a retained id.
    with pytest.raises(DuplicateRequestId):
        store.append([make_record("req-1")])
    clock.now += 45  # req-1 is 75 s old, req-2 45 s
    store.write_snapshot(2, {"v": 2})
    assert store.lookup_request("req-1") is None
    assert store.lookup_request("req-2") is not None
    assert store.recover() == Recovered({"v": 2}, 2, [])


def test_duplicate_request_id_mid_batch_writes_nothing(store_url: str, opened) -> None:
    store = opened(store_url)
    store.append([make_record("old")])
    with pytest.raises(DuplicateRequestId):
        store.append([make_record("new-1"), make_record("new-2"), make_record("old")])
    with pytest.raises(DuplicateRequestId):
        store.append([make_record("new-3"), make_record("new-3")])
    assert store.lookup_request("new-1") is None
    assert [r.request_id for r in store.recover().records] == ["old"]
    # The failed batches consumed no seq_nos.
    assert store.append([make_record("new-1")]) == [2]


BAD_RECORDS = [
    NewRecord("", "op", {}, {}, ""),
    NewRecord("x" * 257, "op", {}, {}, ""),
    NewRecord("id", "", {}, {}, ""),
    NewRecord("id", "op", {"x": float("nan")}, {}, ""),
    NewRecord("id", "op", {"x": object()}, {}, ""),
    NewRecord("id", "op", [], {}, ""),  # type: ignore[arg-type]
    NewRecord("id", "op", {}, {}, None),  # type: ignore[arg-type]
    ("id", "op", {}, {}, ""),
]


def test_invalid_records_are_refused_and_write_nothing(store_url: str, opened) -> None:
    store = opened(store_url)
    for bad in BAD_RECORDS:
        with pytest.raises(InvalidRecord):
            store.append([make_record("good"), bad])
    assert store.recover().records == []
    assert store.last_seq_no == 0


def test_invalid_snapshots_are_refused(store_url: str, opened) -> None:
    store = opened(store_url)
    store.append([make_record("a"), make_record("b")])
    with pytest.raises(InvalidSnapshot):
        store.write_snapshot(3, {})  # beyond the journal
    store.write_snapshot(2, {"v": 2})
    with pytest.raises(InvalidSnapshot):
        store.write_snapshot(1, {})  # older than the current one
    with pytest.raises(InvalidSnapshot):
        store.write_snapshot(2, ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord):
        store.write_snapshot(2, {"x": {1, 2}})
    assert store.recover().snapshot == {"v": 2}


def test_closed_store_refuses_use(store_url: str, opened) -> None:
    store = opened(store_url)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError):
        store.append([make_record("a")])
    with pytest.raises(StoreError):
        store.recover()


def test_random_workload_matches_the_memory_store(durable_url: str, opened) -> None:
    """Differential check: a seeded mix of appends, duplicates, snapshots and lookups gives
    the same observable results on the durable backend as on the in-memory reference."""
    rng = random.Random(1234)
    clock = FakeClock()
    options = StoreOptions(max_retained_requests=5, request_retention_s=20.0, clock=clock)
    durable = opened(durable_url, options)
    reference = opened("memory://", options)
    issued: list[str] = []
    for step in range(60):
        clock.now += rng.uniform(0, 3)
        roll = rng.random()
        if roll < 0.6:
            ids = [f"s{step}-{i}" for i in range(rng.randint(1, 4))]
            if issued and rng.random() < 0.2:
                ids.append(rng.choice(issued))
            batch = [make_record(i, num_seqs=rng.randint(1, 3)) for i in ids]
            outcomes = []
            for store in (durable, reference):
                try:
                    outcomes.append(store.append(batch))
                except DuplicateRequestId:
                    outcomes.append("dup")
            assert outcomes[0] == outcomes[1]
            if outcomes[0] != "dup":
                issued.extend(ids)
        elif roll < 0.8 and reference.last_seq_no:
            seq_no = rng.randint(reference.stats().snapshot_seq_no, reference.last_seq_no)
            for store in (durable, reference):
                store.write_snapshot(seq_no, {"step": step})
        elif issued:
            rid = rng.choice(issued)
            assert durable.lookup_request(rid) == reference.lookup_request(rid)
    assert durable.recover() == reference.recover()
    assert durable.stats().num_journal_records == reference.stats().num_journal_records


def test_payload_digest_is_canonical() -> None:
    assert payload_digest({"b": [1, 2], "a": "é"}) == payload_digest({"a": "é", "b": (1, 2)})
    assert payload_digest({"a": 1}) != payload_digest({"a": 2})
    with pytest.raises(InvalidRecord):
        payload_digest({"a": float("inf")})


def test_concurrent_appends_and_lookups_are_serialised(store_url: str, opened) -> None:
    store = opened(store_url)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(15):
                seq_nos = store.append([make_record(f"w{w}-{i}-{k}") for k in range(1 + i % 2)])
                found = store.lookup_request(f"w{w}-{i}-0")
                if found is None or found.seq_no != seq_nos[0]:
                    raise AssertionError(f"lookup of w{w}-{i}-0 gave {found}")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    records = store.recover().records
    expected = 4 * sum(1 + i % 2 for i in range(15))
    assert [r.seq_no for r in records] == list(range(1, expected + 1))
    assert len({r.request_id for r in records}) == expected


def test_records_after_pages_through_retained_records(store_url: str, opened) -> None:
    store = opened(store_url, StoreOptions(max_retained_requests=3))
    store.append([make_record(f"r{i}") for i in range(8)])
    assert [r.seq_no for r in store.records_after(0, limit=3)] == [1, 2, 3]
    assert [r.seq_no for r in store.records_after(6)] == [7, 8]
    assert store.records_after(8) == []
    store.write_snapshot(6, {})
    # Records 1..5 are pruned (covered and beyond the newest 3): a follower sees the gap.
    assert [r.seq_no for r in store.records_after(0)] == [6, 7, 8]
    for bad in ((-1, 10), (0, -1), ("0", 10), (0, True)):
        with pytest.raises(InvalidRecord):
            store.records_after(*bad)
    with pytest.raises(InvalidRecord):
        store.lookup_request(7)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_retention_s": -1.0},
        {"max_retained_requests": -5},
        {"sqlite_synchronous": "OFF"},
        {"lock_wait_s": -0.1},
        {"snapshot_compress_level": 12},
    ],
)
def test_bad_options_are_refused(kwargs: dict) -> None:
    with pytest.raises(StoreError):
        StoreOptions(**kwargs)


def test_packed_bodies_round_trip_beside_json_ones(store_url: str, opened) -> None:
    """A payload or result the service packed (bytes in its own format: a Step's protobuf)
    comes back as the same `Packed`, NUL bytes and all, next to JSON records of the same batch;
    a format name the stored text could not carry is refused before any I/O."""
    store = opened(store_url)
    data = bytes(range(256)) * 3
    packed = NewRecord("p1", "step", Packed("step-request/1", b"\0" + data), Packed("step-answer/1", data[::-1]), "d")
    store.append([make_record("j1"), packed, make_record("j2")])
    recovered = store.recover()
    assert [type(r.payload) for r in recovered.records] == [dict, Packed, dict]
    got = recovered.records[1]
    assert (got.payload, got.result) == (packed.payload, packed.result)
    found = store.lookup_request("p1")
    assert found is not None and found.result == Packed("step-answer/1", data[::-1])
    assert store.records_after(1, 1)[0].payload == packed.payload
    for bad in ("", "a:b", "x" * 65, "é"):
        with pytest.raises(InvalidRecord, match="packed format"):
            store.append([NewRecord("p2", "step", Packed(bad, b"x"), {}, "d")])
    assert store.last_seq_no == 3


def test_stored_text_that_is_neither_json_nor_packed_is_unreadable() -> None:
    for text in ("packed:step-request/1:not base64!", "packed:nocolon", "[1, 2]", "{oops"):
        with pytest.raises(InvalidRecord):
            decode_body(text)
    assert decode_body(Packed("f/1", b"\0\1").to_text()) == Packed("f/1", b"\0\1")
    assert decode_body(canonical_json({"a": [1]})) == {"a": [1]}
