"""The session table on its own: every applied number above the floor has its answer held, so
no applied number is ever taken for a new one (whatever acks, the cap, the window, in-flight
answers and snapshots do)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from block_manager.service.errors import RequestExpired, RequestIdConflict, SessionExpired, TooManySessions
from block_manager.service.sessions import (
    Answer,
    SessionRef,
    SessionTable,
    parse_session_request_id,
    session_request_id,
)
from block_manager.store.records import Packed, canonical_json

SID = "ab" * 16


def table(**kw: float) -> SessionTable:
    args = {"window_s": 10.0, "ttl_s": 100.0, "max_sessions": 2, "max_answers": 4, **kw}
    t = SessionTable(**args)   # type: ignore[arg-type]
    t.apply("open_session", {"session_id": SID, "client_name": "t"}, 0.0)
    return t


def put(t: SessionTable, seq: int, at: float = 0.0, committed: asyncio.Future[int] | None = None) -> None:
    t.record(SessionRef(SID, seq), Answer(f"d{seq}", {"seq": seq}, at, committed))


def test_held_answer_new_number_and_conflict() -> None:
    t = table()
    assert t.lookup(SessionRef(SID, 1), "d1", 0.0, 0.0) is None
    put(t, 1)
    assert t.lookup(SessionRef(SID, 1), "d1", 1.0, 0.0).result == {"seq": 1}   # type: ignore[union-attr]
    with pytest.raises(RequestIdConflict):
        t.lookup(SessionRef(SID, 1), "other", 1.0, 0.0)
    with pytest.raises(SessionExpired):
        t.lookup(SessionRef("cd" * 16, 1), "d1", 1.0, 0.0)


def test_window_ack_and_cap_raise_the_floor() -> None:
    t = table()
    for seq in (1, 2, 3):
        put(t, seq, at=float(seq))
    with pytest.raises(RequestExpired):          # answer 1 is older than the 10 s window
        t.lookup(SessionRef(SID, 1), "d1", 11.5, 0.0)
    assert t.lookup(SessionRef(SID, 3), "d3", 11.5, 0.0) is not None
    t.lookup(SessionRef(SID, 4, acked=3), "d4", 11.5, 0.0)   # acks 1 and 2
    with pytest.raises(RequestExpired):
        t.lookup(SessionRef(SID, 2), "d2", 11.5, 0.0)
    for seq in range(4, 10):
        put(t, seq, at=11.0)
    sess = t.get(SID)
    assert sess is not None and len(sess.answers) == 4 and sess.floor == 5
    with pytest.raises(RequestExpired):
        t.lookup(SessionRef(SID, 5), "d5", 11.5, 0.0)
    assert t.prune(30.0) == 4 and sess.floor == 9


async def test_an_answer_in_flight_stops_the_floor_below_it() -> None:
    t = table()
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    put(t, 1)
    put(t, 2, committed=fut)
    put(t, 3)
    t.lookup(SessionRef(SID, 4, acked=4), "d4", 0.0, 0.0)   # acks 1..3, but 2 is in flight
    sess = t.get(SID)
    assert sess is not None and sess.floor == 1 and list(sess.answers) == [2, 3]
    assert t.lookup(SessionRef(SID, 2), "d2", 0.0, 0.0) is not None
    fut.set_result(7)
    t.lookup(SessionRef(SID, 4, acked=4), "d4", 0.0, 0.0)
    assert sess.floor == 3 and not sess.answers


def test_random_operations_never_take_an_applied_number_for_a_new_one() -> None:
    rng = random.Random(20)
    for _ in range(50):
        t = table(window_s=5.0, max_answers=rng.randint(1, 6))
        applied: set[int] = set()
        now = 0.0
        for _ in range(80):
            now += rng.random()
            seq = rng.randint(1, 40)
            acked = rng.randint(0, seq)
            try:
                found = t.lookup(SessionRef(SID, seq, acked), f"d{seq}", now, now)
            except RequestExpired:
                assert seq in applied or seq <= t.get(SID).floor   # type: ignore[union-attr]
                continue
            if found is None:
                assert seq not in applied
                applied.add(seq)
                put(t, seq, at=now)
            else:
                assert seq in applied and found.result == {"seq": seq}
            if rng.random() < 0.1:
                t.prune(now)
            if rng.random() < 0.1:   # a restart: snapshot round trip
                snap = t.to_snapshot()
                t = table(window_s=5.0, max_answers=t.max_answers)
                t._sessions.clear()
                t.load_snapshot(snap, now)


def test_sessions_are_capped_expire_when_idle_and_ids_round_trip() -> None:
    t = table(ttl_s=5.0)
    t.apply("open_session", {"session_id": "cd" * 16}, 0.0)
    with pytest.raises(TooManySessions):
        t.can_open()
    t.lookup(SessionRef(SID, 1), "d1", 0.0, 4.0)
    assert t.idle(6.0) == ["cd" * 16]
    t.apply("expire_sessions", {"session_ids": ["cd" * 16]}, 6.0)
    t.can_open()
    assert parse_session_request_id(session_request_id(SID, 12)) == (SID, 12)
    assert parse_session_request_id("plain-request-id") is None


def test_a_packed_answer_survives_a_snapshot_as_text() -> None:
    """A Step's answer is held packed (its response bytes): the snapshot carries it as its
    stored text (JSON-encodable), and a restart holds the same bytes again."""
    t = table()
    answer = Packed("step-answer/1", b"\0\xff resp")
    t.record(SessionRef(SID, 1), Answer("d1", answer, 0.0, None))
    put(t, 2)
    snap = json.loads(canonical_json(t.to_snapshot()))
    restarted = table()
    restarted.load_snapshot(snap, 0.0)
    assert restarted.lookup(SessionRef(SID, 1), "d1", 1.0, 0.0).result == answer   # type: ignore[union-attr]
    assert restarted.lookup(SessionRef(SID, 2), "d2", 1.0, 0.0).result == {"seq": 2}   # type: ignore[union-attr]
