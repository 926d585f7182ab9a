"""docker-compose.yml is what the integration tests run: check it is complete and valid.

No container engine here, so these checks stand in for `docker compose config`: every
service's command is an installed entry point, its environment is accepted by that service's
own config loader, health checks use the gRPC health probe, and the dependency graph is the
one the README describes.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from demo.localstack import COMPOSE_FILE, LocalStack, StackError, interpolate, load_compose
from tests.fixtures.entry_points import declared_entry_points

ROOT = Path(__file__).resolve().parents[1]


def test_interpolation_follows_compose_rules() -> None:
    env = {"A": "x", "EMPTY": ""}
    assert interpolate("${A}", env) == "x"
    assert interpolate("${A:-d}", env) == "x"
    assert interpolate("${EMPTY:-d}", env) == "d"
    assert interpolate("${MISSING:-sqlite:////data/bm.db}", env) == "sqlite:////data/bm.db"
    assert interpolate("${MISSING}", env) == ""


def test_services_and_dependencies() -> None:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    services = doc["services"]
    assert {"block-manager", "compute-node-0", "compute-node-1", "postgres", "model-init",
            "api-server", "api-server-2", "router"} <= set(services)
    for name in ("compute-node-0", "compute-node-1"):
        assert services[name]["depends_on"]["block-manager"]["condition"] == "service_healthy"
        assert services[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
        assert services[name]["environment"]["PAGEDKV_CN_MODEL"] == "/models/${PAGEDKV_MODEL:-tiny-llama}"
        assert services[name]["volumes"] == ["${PAGEDKV_MODEL_DIR:-models}:/models:ro"]
    # two API replicas in fleet mode: distinct scheduler ids, each advertising its own service
    # name (the bound address 0.0.0.0 -> the hostname), each published on its own host port
    replicas = {name: services[name] for name in ("api-server", "api-server-2")}
    assert [api["environment"]["PAGEDKV_API_SCHEDULER_ID"] for api in replicas.values()] == list(replicas)
    assert [api["hostname"] for api in replicas.values()] == list(replicas)
    assert [api["ports"] for api in replicas.values()] == [["8001:8000"], ["8002:8000"]]
    for api in replicas.values():
        for dep in ("block-manager", "compute-node-0", "compute-node-1"):
            assert api["depends_on"][dep]["condition"] == "service_healthy"
        assert api["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
        assert api["command"][:3] == ["pagedkv-serve", "--model", "/models/${PAGEDKV_MODEL:-tiny-llama}"]
        assert api["command"][3:] == ["--block-manager", "block-manager:50051"]       # fleet mode (no --no-fleet)
        assert api["environment"]["PAGEDKV_API_HOST"] == "0.0.0.0"
        assert api["healthcheck"]["test"] == ["CMD", "python", "-m", "engine.api.healthcheck", "127.0.0.1:8000"]
    # the router is the entry point on the published port 8000, with the replicas' API key
    router = services["router"]
    assert router["command"] == ["pagedkv-router", "--model", "/models/${PAGEDKV_MODEL:-tiny-llama}",
                                 "--block-manager", "block-manager:50051"]
    assert router["ports"] == ["8000:8000"]
    assert router["environment"]["PAGEDKV_ROUTER_API_KEY"] == replicas["api-server"]["environment"]["PAGEDKV_API_KEY"]
    assert router["depends_on"]["block-manager"]["condition"] == "service_healthy"
    assert {router["depends_on"][r]["condition"] for r in replicas} == {"service_started"}
    assert router["healthcheck"]["test"] == ["CMD", "python", "-m", "engine.api.healthcheck", "127.0.0.1:8000"]
    published = [p.split(":")[0] for svc in services.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published)), published
    assert services["model-init"]["restart"] == "no" and "models" in doc["volumes"]
    assert services["postgres"]["profiles"] == ["postgres"]
    assert services["block-manager"]["depends_on"]["postgres"]["required"] is False
    assert "bm-data" in doc["volumes"]
    for name in ("block-manager", "compute-node-0", "compute-node-1"):
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "pagedkv.healthcheck"]


def test_commands_are_installed_entry_points() -> None:
    bindir = Path(sys.executable).parent
    declared = set(declared_entry_points()) | {"python"}
    for spec in load_compose(env={}).values():
        exe = spec.command[0]
        assert exe in declared, f"{spec.name}: {exe} is not a [project.scripts] entry point"
        assert (bindir / exe).exists() or shutil.which(exe), f"{spec.name}: {exe} is not installed"


def test_environment_is_accepted_by_each_service_config(tmp_path: Path) -> None:
    from block_manager.service.config import load_config as load_bm
    from compute_node.service.config import load_config as load_cn

    stack = LocalStack(tmp_path, interp_env={})
    loaders = {"block-manager": load_bm, "compute-node-0": load_cn, "compute-node-1": load_cn}
    # A dependant cannot be configured before its dependency published its port (as compose's
    # depends_on orders them); pretend the block manager bound 50999.
    with pytest.raises(StackError, match="block-manager"):
        stack.command("compute-node-0")
    stack.ports[("block-manager", 50051)] = 50999
    for name, loader in loaders.items():
        argv, env = stack.command(name)
        assert argv[-2:] == ["--port-file", str(stack.port_file(name))]
        ours = {k: v for k, v in env.items() if k.startswith("PAGEDKV_")}
        with mock.patch.dict(os.environ, ours, clear=False):
            cfg = loader()
        if name == "block-manager":
            assert cfg.database_url.startswith("sqlite:///") and str(tmp_path) in cfg.database_url
            assert cfg.listen_address == "127.0.0.1:50999"  # a restart rebinds the published port
            assert cfg.metrics_port == 0
            continue
        assert cfg.block_manager_address == "127.0.0.1:50999"
        assert cfg.advertise_address == "127.0.0.1:0"  # the node advertises the port it binds
        assert cfg.device == "cpu"
        # first start: the kernel picks the port (no probe-then-bind race); metrics ephemeral too
        assert cfg.listen_address == "127.0.0.1:0" and cfg.metrics_port == 0
        assert cfg.model == str(tmp_path / "volumes" / "models" / "tiny-llama")    # the named volume
        assert cfg.block_size == 16


def test_api_server_command_is_accepted_by_its_cli(tmp_path: Path) -> None:
    from engine.api.cli import _parser

    stack = LocalStack(tmp_path, interp_env={"PAGEDKV_MODEL_DIR": str(tmp_path / "hf"), "PAGEDKV_MODEL": "Qwen3-0.6B"})
    stack.ports[("block-manager", 50051)] = 50999
    argv, env = stack.command("api-server")
    assert argv[0] == "pagedkv-serve"
    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("PAGEDKV_")}, clear=False):
        args = _parser().parse_args(argv[1:])
    assert args.model == str(tmp_path / "hf" / "Qwen3-0.6B")            # PAGEDKV_MODEL_DIR: a bind mount
    assert args.block_manager == "127.0.0.1:50999"
    assert (args.host, args.port) == ("127.0.0.1", 0)                    # 0.0.0.0:8000 -> loopback, a free port
    assert args.port_file == stack.port_file("api-server")
    assert args.api_key in (None, "") and int(args.max_num_seqs) == 256
    assert stack.specs["api-server"].healthcheck == ["python", "-m", "engine.api.healthcheck", "127.0.0.1:8000"]
    _, env2 = stack.command("api-server-2")
    assert (env["PAGEDKV_API_SCHEDULER_ID"], env2["PAGEDKV_API_SCHEDULER_ID"]) == ("api-server", "api-server-2")
    init_argv, _ = stack.command("model-init")
    assert stack.specs["model-init"].oneshot and not stack.specs["api-server"].oneshot
    assert init_argv == [sys.executable, "-m", "engine.model_init", str(tmp_path / "hf" / "Qwen3-0.6B")]


def test_router_command_is_accepted_by_its_cli(tmp_path: Path) -> None:
    from engine.api.router_cli import _parser

    stack = LocalStack(tmp_path, interp_env={"PAGEDKV_MODEL_DIR": str(tmp_path / "hf"), "PAGEDKV_MODEL": "Qwen3-0.6B",
                                             "PAGEDKV_API_KEY": "k" * 20})
    stack.ports[("block-manager", 50051)] = 50999
    argv, env = stack.command("router")
    assert argv[0] == "pagedkv-router"
    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("PAGEDKV_")}, clear=False):
        args = _parser().parse_args(argv[1:])
    assert args.model == str(tmp_path / "hf" / "Qwen3-0.6B")
    assert args.block_manager == "127.0.0.1:50999"
    assert (args.host, args.port, args.port_file) == ("127.0.0.1", 0, stack.port_file("router"))
    assert args.api_key == "k" * 20
    assert set(stack.specs["router"].depends_on) == {"model-init", "block-manager", "api-server", "api-server-2"}


def test_the_mtls_override_gives_the_new_services_the_scheduler_certificate(tmp_path: Path) -> None:
    """The second replica and the router talk to the block manager with the scheduler's
    certificate under docker-compose.mtls.yml (the router may then Route)."""
    from demo.localstack import MTLS_COMPOSE_FILE
    from engine.api.cli import _parser as serve_parser
    from engine.api.router_cli import _parser as router_parser
    from pagedkv.tls import tls_from_args

    certs = tmp_path / "certs"
    stack = LocalStack(tmp_path, interp_env={"PAGEDKV_CERTS_DIR": str(certs)}, override_files=[MTLS_COMPOSE_FILE])
    stack.ports[("block-manager", 50051)] = 50999
    for name, parser in (("api-server-2", serve_parser), ("router", router_parser)):
        argv, env = stack.command(name)
        with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("PAGEDKV_")}, clear=False):
            tls = tls_from_args(parser().parse_args(argv[1:]))
        assert tls is not None and tls.active, name
        assert (tls.cert_file, tls.key_file, tls.ca_file) == (
            certs / "scheduler.pem", certs / "scheduler-key.pem", certs / "ca.pem"), name


def test_one_shot_services_run_to_completion_first(tmp_path: Path) -> None:
    compose = tmp_path / "compose.yml"
    compose.write_text(yaml.safe_dump({"services": {
        "job": {"command": ["python", "-c", "import pathlib; pathlib.Path('done').write_text('ok')"]},
        "bad": {"command": ["python", "-c", "import sys; print('no model here'); sys.exit(2)"]},
        "svc": {"command": ["python", "-c", "pass"], "ports": ["1234:1234"],
                "depends_on": {"job": {"condition": "service_completed_successfully"},
                               "bad": {"condition": "service_completed_successfully"}}},
    }}))
    stack = LocalStack(tmp_path / "run", compose_file=compose, interp_env={})
    assert stack.specs["job"].oneshot and stack.specs["bad"].oneshot and not stack.specs["svc"].oneshot
    stack.up(["job"])
    assert (tmp_path / "run" / "done").read_text() == "ok" and stack.completed == {"job"}
    with pytest.raises(StackError, match="bad exited with code 2(.|\n)*no model here"):
        stack.up(["svc"])
    assert "svc" not in stack.running          # a dependant never starts after a failed one-shot


def test_dockerfile_installs_through_the_readme_path() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "./scripts/run.sh setup" in dockerfile
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/run.sh test" in readme and "./scripts/run.sh demo" in readme
