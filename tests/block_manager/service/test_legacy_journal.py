"""A journal and a snapshot written before the Step records became binary still recover: the
fixture `golden/legacy_json_journal/` was written by revision d9bd5ee (every record canonical
JSON, session answers in the snapshot as JSON; `golden/make_legacy_journal.py` regenerates it
from a checkout of that revision). Replayed by this tree, or loaded from that snapshot, it gives
the state that server held, the same prefix hits, and its recorded answers (a sessioned retry
gets the recorded response byte for byte); new (binary) records appended after it replay
together with the old ones."""

from __future__ import annotations

import base64
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from block_manager.service.replay import replay_record
from block_manager.service.runtime import ServiceRuntime
from block_manager.service.state import ServiceState
from block_manager.store import open_store
from block_manager.store.snapshot import decode_snapshot, encode_snapshot
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, service_config

FIXTURE = Path(__file__).parent / "golden" / "legacy_json_journal"


def _expected() -> dict[str, Any]:
    return json.loads((FIXTURE / "expected.json").read_text())


def _legacy_db(tmp_path: Path, *, with_snapshot: bool = False) -> str:
    """A fresh SQLite store holding the fixture's rows verbatim (their times moved to now, so the
    session window and the request retention still cover them), and its snapshot if asked."""
    url = f"sqlite:///{tmp_path / 'legacy.db'}"
    open_store(url).close()   # the schema
    rows = [json.loads(line) for line in (FIXTURE / "journal.jsonl").read_text().splitlines()]
    shift = time.time() - rows[-1]["created_at"]
    con = sqlite3.connect(tmp_path / "legacy.db")
    with con:
        con.executemany(
            "INSERT INTO journal (seq_no, request_id, op, payload, result, payload_digest, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(r["seq_no"], r["request_id"], r["op"], r["payload"], r["result"], r["payload_digest"],
              r["created_at"] + shift) for r in rows],
        )
        if with_snapshot:
            snap = json.loads((FIXTURE / "snapshot.json").read_text())
            state = decode_snapshot(snap["encoding"], base64.b64decode(snap["state"]))
            for session in state["sessions"]:   # its answers' times moved to now too (the window)
                for answer in session[3]:
                    answer[3] += shift
            blob = encode_snapshot(state, 1)
            con.execute("INSERT INTO snapshots (seq_no, encoding, state, created_at) VALUES (?, ?, ?, ?)",
                        (snap["seq_no"], snap["encoding"], blob, time.time()))
    con.close()
    return url


async def _routes(h: Harness, prompts: list[list[int]]) -> list[list[list[Any]]]:
    out = []
    for tokens in prompts:
        r = await h.stub.Route(pb.RouteRequest(token_ids=tokens))
        out.append(sorted([e.pool_id, e.num_cached_tokens] for e in r.entries))
    return out


async def test_a_json_journal_of_the_old_format_recovers_state_hits_and_answers(
    start_server: Callable[..., Any], tmp_path: Path,
) -> None:
    expected = _expected()
    url = _legacy_db(tmp_path)
    h: Harness = await start_server(database_url=url)
    runtime = h.server.runtime
    assert runtime is not None and runtime.num_replayed == 11
    assert runtime.state.to_snapshot() == expected["snapshot"]
    assert await _routes(h, expected["route_prompts"]) == expected["routes"]
    assert await h.fsck() == []
    # the sessioned Step, resent: its answer comes from the replayed record, byte for byte
    again = pb.StepRequest.FromString(bytes.fromhex(expected["responses"]["session_request"]))
    again.session.acked = 1
    resp = await h.stub.Step(again)
    assert resp.SerializeToString(deterministic=True).hex() == expected["responses"]["session"]
    assert runtime.state.to_snapshot() == expected["snapshot"]   # answered, not applied again


async def test_a_snapshot_of_the_old_format_recovers_state_hits_and_answers(
    start_server: Callable[..., Any], tmp_path: Path,
) -> None:
    expected = _expected()
    h: Harness = await start_server(database_url=_legacy_db(tmp_path, with_snapshot=True))
    runtime = h.server.runtime
    assert runtime is not None and runtime.num_replayed == 0   # all of it from the snapshot
    assert runtime.state.to_snapshot() == expected["snapshot"]
    assert await _routes(h, expected["route_prompts"]) == expected["routes"]
    again = pb.StepRequest.FromString(bytes.fromhex(expected["responses"]["session_request"]))
    again.session.acked = 1
    resp = await h.stub.Step(again)   # answered from the snapshot's session table (a JSON answer)
    assert resp.SerializeToString(deterministic=True).hex() == expected["responses"]["session"]
    assert runtime.state.to_snapshot() == expected["snapshot"]


async def test_old_and_new_records_replay_together(start_server: Callable[..., Any], tmp_path: Path) -> None:
    url = _legacy_db(tmp_path)
    h: Harness = await start_server(database_url=url)
    h.reports["n1"] = (1, 4, 0)   # the Forwards the fixture's server had returned
    resp = await h.step(allocs=[("d", "n1", [11, 12, 13, 14, 15, 16, 17, 18, 19], 0, None, 0)], request_id="new-1")
    assert not resp.errors and resp.alloc_num_cached_tokens[0] == 8   # the old records' prefix
    assert not (await h.append(("d", 4, [1, 2, 3, 4]), ("b", 2, [5, 6]), request_id="new-2")).errors
    assert not (await h.free("a1", request_id="new-3")).errors
    runtime = h.server.runtime
    assert runtime is not None
    live = runtime.state.to_snapshot()
    await h.channel.close()
    await h.server.stop(0)
    con = sqlite3.connect(tmp_path / "legacy.db")
    (old,) = con.execute("SELECT count(*) FROM journal WHERE payload LIKE '{%'").fetchone()
    con.close()
    assert old == 11
    store = open_store(url)
    try:
        # the stop wrote a snapshot: replay the whole journal instead, old records and new
        assert store.recover().snapshot is not None
        runtime = ServiceRuntime(service_config(database_url=url), store)
        state = ServiceState(runtime.config.state_config())
        sessions = runtime.new_sessions()
        for rec in store.records_after(0, 1000):
            replay_record(state, sessions, rec, 1.0)
        assert state.to_snapshot()["core"] == live["core"]
        assert state.fsck() == []
    finally:
        store.close()
