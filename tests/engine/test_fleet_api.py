"""Fleet mode at the API server's edge (issue 46): `pagedkv-serve --block-manager` joins the fleet
unless `--no-fleet`, its flags become the membership (`--scheduler-id`, `--advertise-url`,
`--nodes`), and `/health` and `/metrics` say whether the engine owns a node."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from block_manager.client import AdminClient
from engine.api.cli import _fleet_settings, _parser, advertise_url, default_scheduler_id, main, node_health_check
from engine.api.server import ServerThread, build_app
from engine.async_engine import AsyncLLMEngine
from engine.fleet import FleetSettings
from engine.llm import LLM
from tests.engine.services import Services
from tests.support.polling import eventually_sync

MODEL = "llama-gqa4-hd64"


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield s
    finally:
        s.close()


def test_block_manager_means_fleet_unless_no_fleet(sock: socket.socket) -> None:
    port = sock.getsockname()[1]
    args = _parser().parse_args(["--model", "m", "--block-manager", "bm:50051"])
    assert _fleet_settings(args, sock) == FleetSettings(address=f"http://127.0.0.1:{port}")
    args = _parser().parse_args(["--model", "m", "--block-manager", "bm:50051", "--nodes", "node-0, node-1",
                                 "--advertise-url", "http://api-0.api:8000", "--scheduler-id", "api-0"])
    assert _fleet_settings(args, sock) == FleetSettings("http://api-0.api:8000", ("node-0", "node-1"))
    assert args.scheduler_id == "api-0"
    assert _fleet_settings(_parser().parse_args(["--model", "m", "--block-manager", "bm:1", "--no-fleet"]),
                           sock) is None
    assert _fleet_settings(_parser().parse_args(["--model", "m"]), sock) is None   # embedded: one scheduler


def test_fleet_flags_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_API_NO_FLEET", "true")
    monkeypatch.setenv("PAGEDKV_API_NODES", "node-1")
    args = _parser().parse_args(["--model", "m"])
    assert args.no_fleet is True and args.nodes == ("node-1",)


def test_the_advertised_url_is_the_bound_port_and_a_dialable_host(sock: socket.socket) -> None:
    port = sock.getsockname()[1]
    assert advertise_url("127.0.0.1", sock) == f"http://127.0.0.1:{port}"
    assert advertise_url("0.0.0.0", sock) == f"http://{socket.gethostname()}:{port}"
    assert advertise_url("::1", sock) == f"http://[::1]:{port}"
    first, second = default_scheduler_id(), default_scheduler_id()
    assert first != second and re.fullmatch(r".+-\d+-[0-9a-f]{6}", first) and first.isascii()


def test_membership_flags_without_a_block_manager_are_a_usage_error(  # type: ignore[no-untyped-def]
        model_dirs, capsys) -> None:
    assert main(["--model", str(model_dirs[MODEL]), "--port", "0", "--nodes", "node-0"]) == 2
    assert "--nodes need --block-manager" in capsys.readouterr().err
    assert main(["--model", str(model_dirs[MODEL]), "--port", "0", "--block-manager", "127.0.0.1:9", "--no-fleet",
                 "--nodes", "node-0"]) == 2
    assert "not with --no-fleet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "m", "--nodes", " , "])


def test_a_member_without_a_node_is_not_ready(tmp_path: Path) -> None:
    ok, detail = asyncio.run(node_health_check(None, {}, fleet=True)())
    assert not ok and "owns no node" in detail
    assert asyncio.run(node_health_check(None, {})()) == (True, "ok")


def _refused(url: str) -> dict[str, Any] | None:
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30)
    return r.json() if r.status_code == 503 else None


def test_health_and_metrics_say_what_each_member_owns(model_dirs) -> None:  # type: ignore[no-untyped-def]
    """Two servers over one block manager with two nodes: one owns both and is ready, the other
    is pinned to a node that does not exist, owns none and answers /health 503; the block
    manager knows each one's advertised address (what routers read)."""
    services = Services(model_dirs[MODEL], num_nodes=2, bm={"scheduler_lease_ttl_s": 3.0})
    bm = services.bm.address
    llms: list[LLM] = []
    try:
        llms.append(LLM(model_dirs[MODEL], block_manager=bm, scheduler_id="api-a",
                        fleet=FleetSettings("http://api-a:8000")))
        llms.append(LLM(model_dirs[MODEL], block_manager=bm, scheduler_id="api-idle",
                        fleet=FleetSettings("http://api-idle:8000", pin_pool_ids=("node-9",))))
        for llm, status, owned in ((llms[0], 200, 2), (llms[1], 503, 0)):
            aeng = AsyncLLMEngine(llm.engine)
            app = build_app(aeng, llm.tokenizer, "m",
                            health_check=node_health_check(bm, llm.engine.nodes, fleet=llm.engine.fleet is not None))
            try:
                with ServerThread(app) as srv:
                    assert httpx.get(srv.url + "/health", timeout=30).status_code == status
                    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
                    assert f'pagedkv_owned_nodes{{model_name="m"}} {float(owned)}' in metrics
                    if not owned:   # after a TTL without a node it refuses: 503, for a router to retry elsewhere
                        refused = eventually_sync(lambda: _refused(srv.url), timeout_s=10, interval_s=0.2,
                                                  what="a nodeless member refuses")
                        assert refused["error"]["code"] == "no_node", refused
            finally:
                aeng.shutdown()
        with AdminClient(bm) as admin:
            members = {m.scheduler_id: m for m in admin.list_schedulers()}
        assert members["api-a"].address == "http://api-a:8000"
        assert set(members["api-a"].pool_ids) == {"node-0", "node-1"}
        assert members["api-idle"].pin_pool_ids == ("node-9",) and members["api-idle"].pool_ids == ()
    finally:
        for llm in llms:
            llm.close()
        services.close()
