"""`pagedkv-router` as a process: flags and their PAGEDKV_ROUTER_* variables, the port file,
a request routed to a fleet member of a real block manager, a clean exit on SIGTERM; usage
errors exit 2 with one line."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from block_manager.client import BlockManagerClient
from demo.localstack import ServiceProcess
from engine.api.router_cli import main
from tests.block_manager.client.server_thread import ServerThread as BlockManagerThread
from tests.compute_node.model.model_helpers import tiny_model_dir
from tests.engine.api.router_fakes import FakeEngine
from tests.engine.conftest import SPECS

ROOT = Path(__file__).resolve().parents[3]
KEY = "router-key-0123456789"


@pytest.fixture(scope="module")
def model_dir(model_root: Path) -> Path:
    return tiny_model_dir(model_root, **{**SPECS["llama-gqa4-hd64"], "seed": 11})


def test_the_router_process_routes_to_a_fleet_member(model_dir: Path, tmp_path: Path) -> None:
    bm = BlockManagerThread()
    try:
        with FakeEngine("a") as a, BlockManagerClient(bm.address, scheduler_id="engine-a", timeout_s=5) as member:
            member.register_node("n1", 64, geometry={"num_layers": 2, "dtype": "float16"}, address="127.0.0.1:9")
            assert [p.pool_id for p in member.scheduler_heartbeat(address=a.url).pools] == ["n1"]
            argv = [sys.executable, "-c", "import sys; from engine.api.router_cli import main; sys.exit(main())",
                    "--model", str(model_dir), "--block-manager", bm.address, "--port", "0"]
            env = {**os.environ, "PAGEDKV_ROUTER_API_KEY": KEY, "PAGEDKV_ROUTER_LOG_LEVEL": "WARNING",
                   "PYTHONPATH": str(ROOT)}
            proc = ServiceProcess.start(argv, workdir=tmp_path, name="router", env=env, cwd=ROOT, timeout_s=60)
            url = f"http://{proc.address}"
            try:
                assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok", "engines": 1}
                assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
                auth = {"Authorization": f"Bearer {KEY}"}
                r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=auth, timeout=10)
                assert r.status_code == 200 and r.json()["engine"] == "a"
                assert "pagedkv_router_routed_by_load_total 1.0" in httpx.get(url + "/metrics", timeout=10).text
            finally:
                assert proc.stop(signal.SIGTERM) == 0
    finally:
        bm.stop()


@pytest.mark.parametrize("argv, message", [
    ([], "--model is required"),
    (["--model", "."], "nothing to route to"),
    (["--model", "/nonexistent", "--engines", "http://127.0.0.1:1"], "has no tokenizer.json"),
])
def test_usage_errors_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
