"""`block-manager admin` as an operator meets it (issue 10): options after the command, node
counts that agree with `admin nodes`, sorted pools, "(none)" for empty lists, and a clear line
when the target is not a block manager."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from block_manager.cli.admin import EXIT_UNREACHABLE, main
from block_manager.client import BlockManagerClient
from demo.localstack import ServiceProcess
from tests.block_manager.client.server_thread import ServerThread
from tests.support.polling import eventually_sync


@pytest.fixture
def short_leases() -> Iterator[ServerThread]:
    st = ServerThread(lease_ttl_s=0.3)
    yield st
    st.stop()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_global_options_may_follow_the_command(capsys: pytest.CaptureFixture[str], bm: ServerThread) -> None:
    code, out, err = _run(capsys, "status", "--target", bm.address, "--timeout", "5")
    assert code == 0 and "serving" in out, err
    code, out, _ = _run(capsys, "--target", "127.0.0.1:1", "--json", "nodes", "--target", bm.address)
    assert code == 0 and json.loads(out) == {"nodes": []}   # the later --target wins


def test_empty_lists_say_none(capsys: pytest.CaptureFixture[str], bm: ServerThread) -> None:
    for command, title in (("status", "pools"), ("nodes", "nodes"), ("seqs", "sequences")):
        code, out, _ = _run(capsys, "--target", bm.address, command)
        assert code == 0 and f"{title}: (none)" in out, out


def test_status_counts_fenced_nodes_and_sorts_pools(
    capsys: pytest.CaptureFixture[str], short_leases: ServerThread
) -> None:
    with BlockManagerClient(short_leases.address) as client:
        for node in ("zeta", "alpha", "mid"):
            client.register_node(node, 8, block_size=4)
    code, out, _ = _run(capsys, "--target", short_leases.address, "status")
    assert code == 0 and "nodes 3 active, 0 fenced" in out
    assert out.index("alpha") < out.index("mid") < out.index("zeta")
    # Nobody heartbeats: every lease lapses.
    eventually_sync(lambda: all(n.fenced for n in short_leases.state.registry.nodes()), what="all fenced")
    code, out, _ = _run(capsys, "--target", short_leases.address, "status")
    assert code == 0 and "nodes 0 active, 3 fenced" in out, out
    code, out, _ = _run(capsys, "--target", short_leases.address, "--json", "nodes")
    assert {(n["node_id"], n["fenced"]) for n in json.loads(out)["nodes"]} == {
        ("alpha", True), ("mid", True), ("zeta", True)
    }
    code, out, _ = _run(capsys, "--target", short_leases.address, "nodes")
    assert out.index("alpha") < out.index("mid") < out.index("zeta")


def test_a_compute_node_target_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "compute_node.service.cli", "serve", "--listen", "127.0.0.1:0",
        "--block-manager", "127.0.0.1:9", "--num-blocks", "16",
    ]
    env = {**os.environ, "PAGEDKV_CN_DEVICE": "cpu"}
    with ServiceProcess.start(argv, workdir=tmp_path, name="node", env=env) as node:
        code, out, err = _run(capsys, "--target", node.address, "status")
    assert code == EXIT_UNREACHABLE and out == ""
    assert err.count("\n") == 1 and "not a block manager" in err and "compute node" in err, err
    assert "pagedkv.v1.ComputeNode" in err and "Method not found" not in err
