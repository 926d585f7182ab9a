"""deploy/kubernetes/: schema-valid (kubernetes-validate, offline), every env var and flag the
manifests set is one the services know (and the settings accept the values), every probe,
Service and NetworkPolicy port is a port the selected container listens on."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from block_manager.service.config import BlockManagerConfig
from block_manager.service.config import load_config as load_bm_config
from block_manager.service.server import REPLICA_HEALTH
from compute_node.service.config import ComputeNodeConfig
from compute_node.service.config import load_config as load_cn_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"   # the oldest Kubernetes the manifests promise to work on (grpc probes: 1.27)
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
ENV_PREFIXES = {  # command -> (env prefix, settings class or None for flag-mirroring env)
    "block-manager": ("PAGEDKV_", BlockManagerConfig),
    "compute-node": ("PAGEDKV_CN_", ComputeNodeConfig),
    "pagedkv-serve": ("PAGEDKV_API_", None),
}


def _docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d)
    return docs


def _workloads() -> list[dict[str, Any]]:
    return [d for d in _docs() if d["kind"] in WORKLOAD_KINDS]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict[str, Any]) -> dict[str, str]:
    """Literal env values with $(VAR) references expanded (downward-API values get a sample)."""
    samples = {"POD_NAME": "compute-node-cpu-5d8f-abcde", "POD_IP": "10.1.2.3"}
    out: dict[str, str] = {}
    for item in container.get("env", []):
        value = item.get("value")
        if value is None:
            value = samples.get(item["name"], "sample-secret-value-0123456789")
        out[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), samples.get(m.group(1), "")), value)
    return out


# ---- schema ---------------------------------------------------------------------------------

def test_every_file_is_listed_in_the_kustomization() -> None:
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("doc", _docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_rejects_a_broken_manifest() -> None:
    """The check above can fail: a misspelled field is refused in strict mode."""
    doc = next(d for d in _docs() if d["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limts"] = {"cpu": "1"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_required_pieces_are_there() -> None:
    docs = _docs()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Namespace", "pagedkv") in kinds
    bm = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "block-manager")
    assert bm["spec"]["replicas"] == 2
    (bm_container,) = bm["spec"]["template"]["spec"]["containers"]
    assert _env(bm_container)["PAGEDKV_FAILOVER__ENABLED"] == "true"
    # Readiness must pass on a healthy standby too, or a rolling update waits forever.
    assert bm_container["readinessProbe"]["grpc"]["service"] == REPLICA_HEALTH
    gpu = next(d for d in docs if d["metadata"]["name"] == "compute-node-gpu")
    limits = gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    assert any(d["metadata"]["name"] == "compute-node-cpu" for d in docs)
    assert ("Service", "api-server") in kinds and ("Deployment", "api-server") in kinds
    assert any(k == "PodDisruptionBudget" for k, _ in kinds)
    assert any(k == "NetworkPolicy" and n == "default-deny-ingress" for k, n in kinds)
    for w in _workloads():
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if w["metadata"]["name"] != "postgres":
            assert annotations.get("prometheus.io/scrape") == "true", w["metadata"]["name"]
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert {"requests", "limits"} <= set(c["resources"]), c["name"]
            assert {"readinessProbe", "livenessProbe"} <= set(c), c["name"]
    secret_volumes = [
        v for w in _workloads() for v in w["spec"]["template"]["spec"].get("volumes", []) if "secret" in v
    ]
    assert any(v["secret"]["secretName"] == "block-manager-config" for v in secret_volumes)


# ---- env vars and flags ---------------------------------------------------------------------

def _setting_exists(settings: type[BaseModel], path: list[str]) -> bool:
    model: Any = settings
    for part in path:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        model = fields[part].annotation
    return True


def env_problems(command: str, env: dict[str, str], flags: set[str]) -> list[str]:
    prefix, settings = ENV_PREFIXES[command]
    problems = []
    for name in env:
        if not name.startswith("PAGEDKV_"):
            continue
        if not name.startswith(prefix) or (command == "block-manager" and name.startswith("PAGEDKV_CN_")):
            problems.append(f"{name}: not a {command} variable (prefix {prefix})")
            continue
        key = name[len(prefix):].lower()
        if settings is not None:
            if not _setting_exists(settings, key.split("__")):
                problems.append(f"{name}: {settings.__name__} has no setting {key!r}")
        elif "--" + key.replace("_", "-") not in flags and name != "PAGEDKV_API_KEY":
            problems.append(f"{name}: {command} has no flag --{key.replace('_', '-')}")
    return problems


def _entry_point(command: str) -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts[command]


def _flags(command: str, subcommands: list[str]) -> set[str]:
    module, func = _entry_point(command).split(":")
    code = f"import sys, {module} as m; sys.exit(m.{func}({[*subcommands, '--help']!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", proc.stdout))


def _service_containers() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for w in _workloads():
        for c in _containers(w):
            if c.get("command") and c["command"][0] in ENV_PREFIXES:
                out.append((w["metadata"]["name"], c))
    return out


def test_every_env_var_and_flag_exists_in_the_services_settings() -> None:
    containers = _service_containers()
    assert {c["command"][0] for _, c in containers} == set(ENV_PREFIXES)
    problems = []
    flag_cache: dict[tuple[str, ...], set[str]] = {}
    for workload, c in containers:
        command = c["command"]
        subcommands = [a for a in command[1:2] if not a.startswith("-")]
        key = (command[0], *subcommands)
        if key not in flag_cache:
            flag_cache[key] = _flags(command[0], subcommands)
        flags = flag_cache[key]
        problems += [f"{workload}: {flag} unknown" for flag in command if flag.startswith("--") and flag not in flags]
        problems += [f"{workload}: {p}" for p in env_problems(command[0], _env(c), flags)]
    assert problems == []


def test_env_check_catches_an_unknown_variable() -> None:
    assert env_problems("block-manager", {"PAGEDKV_LISTEN_ADRESS": "x"}, set())
    assert env_problems("compute-node", {"PAGEDKV_CN_GEOMETRY__NUM_LAYRS": "2"}, set())
    assert env_problems("pagedkv-serve", {"PAGEDKV_API_NO_SUCH": "1"}, {"--port"})
    assert not env_problems("compute-node", {"PAGEDKV_CN_GEOMETRY__NUM_LAYERS": "2"}, set())


def test_the_settings_accept_the_manifests_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = next(d for d in _docs() if d["kind"] == "Secret" and d["metadata"]["name"] == "block-manager-config")
    config_file = tmp_path / "block-manager.yaml"
    config_file.write_text(secret["stringData"]["block-manager.yaml"])
    for _, c in _service_containers():
        with monkeypatch.context() as mp:
            for name, value in _env(c).items():
                mp.setenv(name, value)
            if c["command"][0] == "block-manager":
                cfg = load_bm_config(config_file)
                assert cfg.database_url.startswith("postgresql") and cfg.failover.enabled
            elif c["command"][0] == "compute-node":
                cfg = load_cn_config(None)
                assert cfg.node_id.startswith("compute-node") and cfg.memory_budget_bytes


def test_python_modules_in_commands_exist() -> None:
    for w in _workloads():
        for c in _containers(w):
            cmd = c.get("command", [])
            if cmd[:2] == ["python", "-m"]:
                assert importlib.util.find_spec(cmd[2]) is not None, cmd


# ---- ports ----------------------------------------------------------------------------------

def _listen_ports(c: dict[str, Any]) -> set[int]:
    """Ports the container's process listens on, from its settings (env) or its image default."""
    env = _env(c)
    ports = set()
    for name, value in env.items():
        if name.endswith("LISTEN_ADDRESS"):
            ports.add(int(value.rsplit(":", 1)[1]))
        if name.endswith("METRICS_PORT") or name == "PAGEDKV_API_PORT":
            ports.add(int(value))
    if c.get("image", "").startswith("postgres:"):
        ports.add(5432)
    return ports


def _resolve(port: int | str, c: dict[str, Any]) -> int | None:
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    return None


def test_probes_point_at_ports_the_containers_listen_on() -> None:
    checked = 0
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            listening = _listen_ports(c)
            declared = {int(p["containerPort"]) for p in c.get("ports", [])}
            assert declared <= listening, (w["metadata"]["name"], declared, listening)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                for handler in ("grpc", "httpGet", "tcpSocket"):
                    if handler in probe:
                        port = _resolve(probe[handler]["port"], c)
                        assert port in listening, (w["metadata"]["name"], kind, probe)
                        checked += 1
                if "exec" in probe:
                    for arg in probe["exec"]["command"]:
                        m = re.fullmatch(r"[\w.-]+:(\d+)", arg)
                        if m:
                            assert int(m.group(1)) in listening, (w["metadata"]["name"], kind, arg)
    assert checked >= 10


def test_services_and_network_policies_use_container_ports() -> None:
    docs = _docs()
    pods = [(w["spec"]["template"]["metadata"]["labels"], w["spec"]["template"]["spec"]["containers"])
            for w in _workloads()]

    def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [c for labels, cs in pods if selector.items() <= labels.items() for c in cs]

    for d in docs:
        if d["kind"] == "Service":
            containers = selected(d["spec"]["selector"])
            assert containers, d["metadata"]["name"]
            for p in d["spec"]["ports"]:
                assert any(_resolve(p["targetPort"], c) for c in containers), (d["metadata"]["name"], p)
        if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]:
            containers = selected(d["spec"]["podSelector"]["matchLabels"])
            assert containers, d["metadata"]["name"]
            for rule in d["spec"].get("ingress", []):
                for p in rule.get("ports", []):
                    assert any(_resolve(p["port"], c) for c in containers), (d["metadata"]["name"], p)
                for peer in rule.get("from", []):
                    if "podSelector" in peer:
                        assert selected(peer["podSelector"]["matchLabels"]), (d["metadata"]["name"], peer)
