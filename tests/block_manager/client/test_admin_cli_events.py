"""`block-manager admin events`: the snapshot as JSON lines (replayed, it equals the block
manager's prefix indexes), `--follow` printing live events as a real process and stopping at
`--max-events`, Ctrl-C and a closed pipe ending quietly, usage errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from block_manager.cli.admin import EXIT_USAGE, main
from block_manager.client import BlockManagerClient
from block_manager.service.kv_events import salt_id
from tests.block_manager.client.step_workload import forwarded
from tests.support.polling import eventually_sync

REPO = Path(__file__).resolve().parents[3]
SCHEDULER = "events-cli-test"


def populate(address: str) -> BlockManagerClient:
    c = BlockManagerClient(address, scheduler_id=SCHEDULER)
    c.register_node("n1", 32, block_size=4)
    step = c.step()
    step.allocate("s1", "n1", list(range(10)))
    step.allocate("s2", "n1", list(range(50, 59)), salt="tenant-a")
    assert not forwarded(c, step.commit()).failures
    return c


def expected(bm) -> dict:
    def view():
        return {f"{pool}/{tier}": {h.hex(): [None if p is None else p.hex(), salt_id(s), n]
                                   for h, (p, s, n) in entries.items()}
                for (pool, tier), entries in bm.state.core.kv_index_view().items()}

    async def read():
        return view()

    return bm.lt.run(read())


def replay(lines: list[dict]) -> dict:
    view: dict = {}
    for d in lines:
        if d["kind"] == "block_stored":
            entries = view.setdefault(f"{d['node_id']}/{d['tier']}", {})
            parent = d["parent_hash"]
            for h in d["block_hashes"]:
                entries[h] = [parent, d["salt_id"] or "", d["num_tokens"] // len(d["block_hashes"])]
                parent = h
    return view


def cli(address: str) -> list[str]:
    return [sys.executable, "-m", "block_manager.cli.main", "admin", "--target", address]


def test_events_json_prints_the_snapshot_and_exits(capsys, bm) -> None:
    with populate(bm.address):
        code = main(["--target", bm.address, "--json", "events"])
        out = capsys.readouterr().out
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["kind"] == "resync" and lines[0]["reason"] == "no view yet"
    assert lines[-1]["kind"] == "snapshot_end" and lines[-1]["num_blocks"] == len(lines) - 2
    assert {d["event_id"] for d in lines} == {bm.server.runtime.kv_events.head}
    assert replay(lines) == expected(bm) and len(lines) - 2 == 4   # 2 full blocks of each prompt
    # the human view: one line per event
    assert main(["--target", bm.address, "events"]) == 0
    human = capsys.readouterr().out.splitlines()
    assert len(human) == len(lines) and "resync" in human[0] and "node=n1 tier=device" in human[1]


def test_follow_prints_live_events_until_max_events(bm) -> None:
    with populate(bm.address) as c:
        hub = bm.server.runtime.kv_events
        proc = subprocess.Popen([*cli(bm.address), "--json", "events", "--follow", "--max-events", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            eventually_sync(lambda: hub.subscribers, timeout_s=60, what="the CLI subscribed")
            step = c.step()
            step.allocate("s3", "n1", list(range(200, 209)))
            forwarded(c, step.commit())
            c.free(["s1"])
            step = c.step()
            step.allocate("s4", "n1", list(range(300, 309)), salt="tenant-b")
            forwarded(c, step.commit())
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [d["kind"] for d in lines] == ["block_stored", "block_stored"]   # live only: no snapshot
    assert lines[0]["event_id"] < lines[1]["event_id"] and lines[1]["salt_id"] == salt_id("tenant-b")
    assert len(lines[0]["block_hashes"]) == 2 and lines[0]["num_tokens"] == 8 and lines[0]["node_id"] == "n1"


def test_ctrl_c_and_a_closed_pipe_end_quietly(bm) -> None:
    with populate(bm.address):
        hub = bm.server.runtime.kv_events
        proc = subprocess.Popen([*cli(bm.address), "events", "--follow", "--from", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            eventually_sync(lambda: hub.subscribers, timeout_s=60, what="the CLI subscribed")
            first = proc.stdout.readline()   # type: ignore[union-attr]
            assert "resync" in first
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            gone = subprocess.run([*cli(bm.address), "--json", "events"], stdout=write_end, stderr=subprocess.PIPE,
                                  text=True, cwd=REPO, timeout=60)
        finally:
            os.close(write_end)
        assert gone.returncode == 0 and "Traceback" not in gone.stderr and "BrokenPipe" not in gone.stderr


def test_usage_errors(capsys, bm) -> None:
    assert main(["--target", bm.address, "events", "--from", "3"]) == EXIT_USAGE
    assert "--from needs --follow" in capsys.readouterr().err
    assert main(["--target", bm.address, "events", "--follow", "--max-events", "-1"]) == EXIT_USAGE
