"""docker-compose.mtls.yml merges onto docker-compose.yml as compose does, and what it gives
each service is a valid mutual-TLS configuration naming files the dev-CA script writes."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import yaml

from demo.localstack import COMPOSE_FILE, MTLS_COMPOSE_FILE, LocalStack, merge_compose
from tests.fixtures.certs import DevCerts


def test_merge_follows_compose_rules() -> None:
    base = {"services": {"a": {"command": ["x"], "environment": {"A": "1", "B": "2"},
                               "volumes": ["data:/data", "./old:/certs"], "ports": ["1:1"],
                               "healthcheck": {"test": ["CMD", "probe"], "interval": "5s"}}}}
    override = {"services": {"a": {"environment": {"B": "3", "C": "4"}, "volumes": ["/new:/certs:ro"],
                                   "ports": ["2:2"], "healthcheck": {"test": ["CMD", "probe", "--tls"]}}}}
    a = merge_compose(base, override)["services"]["a"]
    assert a["environment"] == {"A": "1", "B": "3", "C": "4"}
    assert a["volumes"] == ["data:/data", "/new:/certs:ro"]
    assert a["ports"] == ["1:1", "2:2"] and a["command"] == ["x"]
    assert a["healthcheck"] == {"test": ["CMD", "probe", "--tls"], "interval": "5s"}


def test_mtls_override_configures_every_service(tmp_path: Path, dev_certs: DevCerts) -> None:
    from block_manager.service.config import load_config as load_bm
    from compute_node.service.config import load_config as load_cn

    services = yaml.safe_load(MTLS_COMPOSE_FILE.read_text())["services"]
    # every gRPC service and the API server (a scheduler); model-init needs nothing
    assert set(services) == set(yaml.safe_load(COMPOSE_FILE.read_text())["services"]) - {"postgres", "model-init"}
    stack = LocalStack(tmp_path, interp_env={"PAGEDKV_CERTS_DIR": str(dev_certs.dir)},
                       override_files=[MTLS_COMPOSE_FILE])
    stack.ports[("block-manager", 50051)] = 50999
    for name, loader in (("block-manager", load_bm), ("compute-node-0", load_cn), ("compute-node-1", load_cn)):
        _, env = stack.command(name)
        ours = {k: v for k, v in env.items() if k.startswith("PAGEDKV_")}
        with mock.patch.dict(os.environ, ours, clear=False):
            cfg = loader()
        assert cfg.tls.active and cfg.tls.require_client_cert and cfg.auth_enabled, name
        for path in (cfg.tls.cert_file, cfg.tls.key_file, cfg.tls.ca_file):
            assert path is not None and path.parent == dev_certs.dir and path.is_file(), (name, path)
        assert stack.specs[name].healthcheck[-2] == "--tls-env"   # type: ignore[index]
    assert stack.command("compute-node-1")[1]["PAGEDKV_CN_TLS__CERT_FILE"].endswith("compute-node-1.pem")
    # the API server parses its certificate options into a scheduler's mutual-TLS client settings
    from engine.api.cli import _parser
    from pagedkv.tls import tls_from_args

    argv, env = stack.command("api-server")
    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("PAGEDKV_")}, clear=False):
        tls = tls_from_args(_parser().parse_args(argv[1:]))
    assert tls is not None and tls.active and not stack.specs["api-server"].profiles
    assert tls.cert_file == dev_certs.dir / "scheduler.pem" and tls.key_file == dev_certs.dir / "scheduler-key.pem"
    assert tls.ca_file == dev_certs.dir / "ca.pem"
