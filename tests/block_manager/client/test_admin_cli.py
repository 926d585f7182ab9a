"""`block-manager admin`: every subcommand (tables and --json), exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from block_manager.cli.admin import EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE, main
from block_manager.client import BlockManagerClient, ItemFailure
from demo.localstack import ServiceProcess
from tests.block_manager.client.step_workload import forwarded
from tests.support.http1 import http1_port

SCHEDULER = "admin-cli-test"

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def populated(bm_token):
    with BlockManagerClient(bm_token.address, scheduler_id=SCHEDULER) as c:
        c.register_node(
            "n1", 32, block_size=4, geometry={"device": "cpu", "dtype": "float16"}, address="127.0.0.1:7001"
        )
        c.register_node("n2", 16, block_size=4)
        step = c.step()
        step.allocate("s1", "n1", list(range(10)))
        step.allocate("s2", "n1", num_tokens=3)
        step.allocate("s3", "n2", num_tokens=9)
        step.allocate("tmp", "n1", list(range(100, 108)))
        assert not forwarded(c, step.commit()).failures
        c.free(["tmp"])  # two cached prefix blocks
    return bm_token


def run(capsys, bm, *argv: str, token: str | None = "s3cret") -> tuple[int, str, str]:
    base = ["--target", bm.address] + (["--token", token] if token else [])
    code = main([*base, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_status_nodes_seqs_table(capsys, populated):
    code, out, _ = run(capsys, populated, "status")
    assert code == 0 and "serving" in out and "n1" in out and "n2" in out
    code, out, _ = run(capsys, populated, "--json", "status")
    status = json.loads(out)
    assert code == 0 and status["num_sequences"] == 3 and {p["pool_id"] for p in status["pools"]} == {"n1", "n2"}
    code, out, _ = run(capsys, populated, "nodes")
    assert code == 0 and "127.0.0.1:7001" in out and "float16" in out
    nodes = json.loads(run(capsys, populated, "--json", "nodes")[1])["nodes"]
    assert [n["node_id"] for n in nodes] == ["n1", "n2"] and nodes[0]["epoch"] == 1
    code, out, _ = run(capsys, populated, "seqs", "--pool", "n1")
    assert code == 0 and "s1" in out and "s2" in out and "s3" not in out
    seqs = json.loads(run(capsys, populated, "--json", "seqs")[1])
    assert sorted(s["seq_id"] for s in seqs["sequences"]) == ["s1", "s2", "s3"] and seqs["truncated"] is False
    code, out, _ = run(capsys, populated, "table", "s1")
    assert code == 0 and "tokens 10" in out and "8-9" in out
    table = json.loads(run(capsys, populated, "--json", "table", "s1")[1])
    assert table["num_blocks"] == 3 and len(table["table"]["block_table"]) == 3
    code, _, err = run(capsys, populated, "table", "nope")
    assert code == EXIT_REFUSED and err.startswith("block-manager admin: error: not found:") and err.count("\n") == 1


def test_mutating_subcommands(capsys, populated):
    code, out, _ = run(capsys, populated, "drain", "n2")
    assert code == 0 and "draining (1 live sequences)" in out
    assert populated.state.registry.get("n2").draining
    with BlockManagerClient(populated.address, scheduler_id=SCHEDULER) as c:
        step = c.step()
        step.allocate("x", "n2", num_tokens=1)
        fail = step.commit().allocations["x"]
        assert isinstance(fail, ItemFailure) and fail.error.reason == "PoolDraining"
    code, out, _ = run(capsys, populated, "--json", "drain", "n2", "--undrain")
    assert code == 0 and json.loads(out) == {"num_sequences": 1}
    code, out, _ = run(capsys, populated, "reset-prefix-cache", "--pool", "n1")
    assert code == 0 and "reset 2 cached block(s)" in out
    code, out, _ = run(capsys, populated, "--json", "defrag", "n1", "--kind", "compaction")
    assert code == 0 and isinstance(json.loads(out)["plans"], list)
    code, out, _ = run(capsys, populated, "fsck")
    assert code == 0 and "fsck: ok" in out
    assert json.loads(run(capsys, populated, "--json", "fsck")[1]) == {"ok": True, "problems": []}
    code, _, err = run(capsys, populated, "drain", "ghost")
    assert code == EXIT_REFUSED and err.startswith("block-manager admin: error: not found:")


def test_fsck_problems_exit_1(capsys, populated):
    async def corrupt() -> None:  # a pool without an active node: fsck must say so
        populated.state.core.add_pool("orphan", 4, 4)

    populated.lt.run(corrupt())
    code, out, _ = run(capsys, populated, "fsck")
    assert code == EXIT_REFUSED and "1 problem(s)" in out and "orphan" in out
    code, out, _ = run(capsys, populated, "--json", "fsck")
    assert code == EXIT_REFUSED and json.loads(out)["ok"] is False


def test_auth_unreachable_usage(capsys, populated, monkeypatch):
    code, _, err = run(capsys, populated, "status", token=None)
    assert code == EXIT_REFUSED and err.startswith("block-manager admin: error: unauthenticated:")
    assert err.count("\n") == 1
    code, _, err = run(capsys, populated, "status", token="wrong")
    assert code == EXIT_REFUSED and "unauthenticated" in err
    monkeypatch.setenv("PAGEDKV_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("PAGEDKV_ADMIN_TARGET", populated.address)
    assert main(["status"]) == 0
    capsys.readouterr()
    code = main(["--target", "127.0.0.1:1", "--timeout", "1", "status"])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE
    assert err == "block-manager admin: error: cannot reach block manager at 127.0.0.1:1 (UNAVAILABLE)\n"
    assert main(["frobnicate"]) == EXIT_USAGE
    assert main(["--timeout", "0", "status"]) == EXIT_USAGE


def test_an_http_port_is_named_as_such(capsys):
    """`admin --target` at the OpenAI server's port (plain HTTP/1): said so, not "cannot reach"."""
    with http1_port() as port:
        code = main(["--target", f"127.0.0.1:{port}", "--timeout", "5", "status"])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE and err.count("\n") == 1, err
    assert "answers plain HTTP, not gRPC: not a block manager" in err, err


def test_cli_subprocess_against_served_process(tmp_path):
    env = {**os.environ, "PAGEDKV_ADMIN_TOKEN": "tok", "PAGEDKV_LOG_LEVEL": "WARNING"}
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url", "memory://"]
    server = ServiceProcess.start(argv, workdir=tmp_path, name="bm", env=env, cwd=REPO, timeout_s=30)
    try:
        target = server.address
        cli = [sys.executable, "-m", "block_manager.cli.main", "admin", "--target", target]
        ok = subprocess.run(
            [*cli, "--token", "tok", "--json", "status"], capture_output=True, text=True, cwd=REPO, timeout=60
        )
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["state"] == "serving"
        bad = subprocess.run([*cli, "--token", "nope", "nodes"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert (
            bad.returncode == EXIT_REFUSED
            and bad.stderr.startswith("block-manager admin: error: unauthenticated:")
            and "Traceback" not in bad.stderr
        )
    finally:
        assert server.stop(timeout_s=20) == 0


def _big_pool(pool_id: str) -> dict:
    return dict(pool_id=pool_id, num_blocks=1048576, block_size=16, num_free_blocks=524288, num_used_blocks=524288,
                num_cached_blocks=123456, num_reserved_blocks=65536, usage=0.5, high_water_mark=1000000,
                num_sequences=4096, num_tokens=12345678, waste_slots=123457, prefix_hit_tokens=1,
                prefix_query_tokens=3, cow_copies=12345, evictions=234567, defrag_moves=345678, contiguity=0.987)


def test_status_fits_80_columns_without_cutting_a_cell():
    """Seven-digit counters and eleven-character pool ids: every value whole, no line over 80."""
    import io

    from rich.console import Console

    from block_manager.cli.admin import _show_status

    status = dict(state="serving", store="sqlite:///var/lib/pagedkv/bm.db", num_nodes=2, num_sequences=8192,
                  last_seq_no=123456789, uptime_s=86400.0, pools=[_big_pool("gpu-node-01"), _big_pool("gpu-node-00")],
                  _nodes=[{"fenced": False, "draining": True}, {"fenced": False, "draining": False}])
    buf = io.StringIO()
    _show_status(Console(file=buf, width=80, highlight=False), status)
    out = buf.getvalue()
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80, out
    assert "…" not in out, out
    for value in ("gpu-node-00", "gpu-node-01", "1048576", "524288", "123456", "65536", "50.0%", "1000000", "4096",
                  "12345678", "123457", "33.3%", "12345", "234567", "345678", "0.99", "123456789", "86400s",
                  "sqlite:///var/lib/pagedkv/bm.db", "2 active (1 draining), 0 fenced"):
        assert value in out, (value, out)
    assert out.index("gpu-node-00") < out.index("gpu-node-01")


def test_status_in_an_80_column_terminal_and_json_into_a_closed_pipe(tmp_path, populated):
    """A real process: the human view at COLUMNS=80 (as a terminal would be) fits; `--json`
    into a pipe whose reader is gone (`| head`) exits quietly, no BrokenPipeError traceback."""
    env = {**os.environ, "PAGEDKV_ADMIN_TOKEN": "s3cret", "COLUMNS": "80", "TTY_COMPATIBLE": "1"}
    cli = [sys.executable, "-m", "block_manager.cli.main", "admin", "--target", populated.address]
    wide = subprocess.run([*cli, "--json", "status"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert wide.returncode == 0 and json.loads(wide.stdout)["num_sequences"] == 3
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        gone = subprocess.run([*cli, "--json", "status"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=env, timeout=60)
    finally:
        os.close(write_end)
    assert gone.returncode == 1 and "Traceback" not in gone.stderr and "BrokenPipe" not in gone.stderr, gone.stderr


def test_nodes_show_both_tiers(capsys, bm_token):
    """`nodes` lists each node's host tier beside its device tier (a second narrow table), with
    the blocks a swap-out moved there counted as used; `--json` carries the same fields."""
    with BlockManagerClient(bm_token.address, scheduler_id=SCHEDULER) as c:
        c.register_node("h1", 8, block_size=4, host_num_blocks=24)
        c.register_node("d1", 8, block_size=4)
        step = c.step()
        step.allocate("s1", "h1", num_tokens=10)
        assert not forwarded(c, step.commit()).failures
        step = c.step()
        step.swap_out(["s1"])
        assert not forwarded(c, step.commit()).failures
    nodes = {n["node_id"]: n for n in json.loads(run(capsys, bm_token, "--json", "nodes")[1])["nodes"]}
    assert (nodes["h1"]["host_num_blocks"], nodes["h1"]["host_used_blocks"], nodes["h1"]["host_free_blocks"]) == (
        24, 3, 21)
    assert nodes["d1"]["host_num_blocks"] == 0 and nodes["d1"]["num_blocks"] == 8
    code, out, _ = run(capsys, bm_token, "nodes")
    host = out[out.index("host tier"):]
    assert code == 0 and "h1" in host and "d1" not in host and "24" in host and "21" in host, out


def test_nodes_fit_80_columns_with_a_host_tier():
    """Both tables of `nodes` stay within 80 columns with long ids and seven-digit counts."""
    import io

    from rich.console import Console

    from block_manager.cli.admin import _show_nodes

    node = dict(node_id="gpu-node-01", epoch=123, address="10.200.100.123:50051", num_blocks=1048576, block_size=16,
                geometry={"device": "cuda:0", "dtype": "bfloat16"}, draining=False, fenced=False,
                lease_remaining_s=29.5, host_num_blocks=4194304, host_free_blocks=3145728, host_used_blocks=1000000,
                host_cached_blocks=48576)
    buf = io.StringIO()
    _show_nodes(Console(file=buf, width=80, highlight=False), {"nodes": [node]})
    out = buf.getvalue()
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80, out
    assert "…" not in out, out
    for value in ("gpu-node-01", "10.200.100.123:50051", "1048576", "bfloat16", "4194304", "3145728", "1000000",
                  "48576", "host tier"):
        assert value in out, (value, out)
