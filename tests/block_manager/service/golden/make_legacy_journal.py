"""Writes `legacy_json_journal/`: a journal written by the block manager before its Step records
became binary (revision d9bd5ee: every record canonical JSON), with what that server answered
and held, for `test_legacy_journal.py`.

Run it from a checkout of that revision (the imports resolve there, not here):

    git worktree add /tmp/base45 d9bd5ee
    cd /tmp/base45 && /work/main/.venv/bin/python \
        /work/main/tests/block_manager/service/golden/make_legacy_journal.py \
        /work/main/tests/block_manager/service/golden/legacy_json_journal

Written: `journal.jsonl` (one journal row per line, the stored text of its payload and result
verbatim), `snapshot.json` (the snapshot row that server wrote when it stopped, its blob in
base64: the state and the client sessions, their answers in the JSON form) and
`expected.json` (the live state's snapshot, the routes' prefix hits and the responses of the
Steps, as that server gave them).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())

import grpc  # noqa: E402

from block_manager.service.server import BlockManagerServer  # noqa: E402
from pagedkv.v1 import block_manager_pb2 as pb  # noqa: E402
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402
from tests.block_manager.service.service_helpers import Harness, service_config, step_request  # noqa: E402

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]   # 3 full blocks of 4 + 1
ROUTES = [PROMPT, PROMPT[:8], [*PROMPT, 30, 31, 32], [1, 2, 3, 4, 5]]


async def scenario(h: Harness, responses: dict[str, str]) -> None:
    def keep(name: str, resp: pb.StepResponse) -> None:
        responses[name] = resp.SerializeToString(deterministic=True).hex()

    await h.register("n1", num_blocks=64, block_size=4)
    await h.register("n2", num_blocks=64, block_size=4)
    keep("alloc", await h.step(allocs=[("a", "n1", PROMPT, 0, None, 0), ("c", "n2", None, 6, None, 0)]))
    keep("hit", await h.allocate("b", "n1", tokens=[*PROMPT, 30, 31, 32]))   # 3 blocks cached
    keep("append", await h.append(("a", 3, [40, 41, 42]), ("b", 1, [33]), ("c", 2, [80, 81])))
    keep("fork", await h.fork("a", "a1", "a2"))
    keep("append2", await h.append(("a1", 2, [50, 51]), ("a2", 5, [60, 61, 62, 63, 64])))
    keep("free", await h.free("a2", "c"))
    keep("salted", await h.allocate("s", "n2", tokens=PROMPT, salt="tenant"))
    # a sessioned Step: its answer is recorded under the session's number
    opened = await h.stub.OpenSession(pb.OpenSessionRequest(client_name="legacy"))
    req = step_request(appends=[("s", 1, [70])], reports=dict(h.reports))
    req.session.session_id, req.session.seq, req.session.acked = opened.session_id, 1, 0
    resp = await h.stub.Step(req)
    keep("session", resp)
    responses["session_request"] = req.SerializeToString(deterministic=True).hex()


async def main(out: Path) -> None:
    db = Path(tempfile.mkdtemp(prefix="legacy-journal-")) / "bm.db"
    server = BlockManagerServer(service_config(database_url=f"sqlite:///{db}", snapshot_every_records=100_000,
                                               snapshot_interval_s=3600.0))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h = Harness(server, channel, pb_grpc.BlockManagerStub(channel), pb_grpc.BlockManagerAdminStub(channel))
    responses: dict[str, str] = {}
    await scenario(h, responses)
    routes = []
    for tokens in ROUTES:
        r = await h.stub.Route(pb.RouteRequest(token_ids=tokens))
        routes.append(sorted([e.pool_id, e.num_cached_tokens] for e in r.entries))
    runtime = server.runtime
    assert runtime is not None
    snapshot = runtime.state.to_snapshot()
    con = sqlite3.connect(db)
    rows = con.execute("SELECT seq_no, request_id, op, payload, result, payload_digest, created_at "
                       "FROM journal ORDER BY seq_no").fetchall()
    con.close()
    await channel.close()
    await server.stop(0)   # writes the final snapshot
    con = sqlite3.connect(db)
    snap = con.execute("SELECT seq_no, encoding, state, created_at FROM snapshots").fetchone()
    con.close()
    out.mkdir(parents=True, exist_ok=True)
    keys = ("seq_no", "request_id", "op", "payload", "result", "payload_digest", "created_at")
    (out / "journal.jsonl").write_text("".join(json.dumps(dict(zip(keys, row)), sort_keys=True) + "\n" for row in rows))
    expected = {"snapshot": snapshot, "routes": routes, "route_prompts": ROUTES, "responses": responses}
    (out / "snapshot.json").write_text(json.dumps(
        {"seq_no": snap[0], "encoding": snap[1], "state": base64.b64encode(snap[2]).decode(), "created_at": snap[3]},
        sort_keys=True) + "\n")
    (out / "expected.json").write_text(json.dumps(expected, sort_keys=True, indent=1) + "\n")
    print(f"{len(rows)} records -> {out}")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
