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

import grpc
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from block_manager.service.config import BlockManagerConfig
from block_manager.service.config import load_config as load_bm_config
from block_manager.service.server import REPLICA_HEALTH
from compute_node.service.config import ComputeNodeConfig
from compute_node.service.config import load_config as load_cn_config
from tests.support import fork_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"   # the oldest Kubernetes the manifests promise to work on (grpc probes: 1.27)
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
ENV_PREFIXES = {  # command -> (env prefix, settings class or None for flag-mirroring env)
    "block-manager": ("PAGEDKV_", BlockManagerConfig),
    "compute-node": ("PAGEDKV_CN_", ComputeNodeConfig),
    "pagedkv-serve": ("PAGEDKV_API_", None),
    "pagedkv-router": ("PAGEDKV_ROUTER_", None),
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


def _env(container: dict[str, Any], pod_name: str = "compute-node-cpu-1") -> dict[str, str]:
    """Literal env values with $(VAR) references expanded (downward-API values get a sample:
    `pod_name` for metadata.name)."""
    samples = {"POD_NAME": pod_name, "POD_IP": "10.1.2.3", "POD_NAMESPACE": "pagedkv"}
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
    probe = bm_container["readinessProbe"]["exec"]["command"]
    assert probe[probe.index("--service") + 1] == REPLICA_HEALTH
    gpu = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "compute-node-gpu")
    limits = gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    assert any(d["metadata"]["name"] == "compute-node-cpu" for d in docs)
    assert ("Deployment", "api-server") in kinds
    # fleet mode: the router Service is the public face, the API replicas sit behind it
    assert ("Service", "router") in kinds and ("Deployment", "router") in kinds
    assert ("Service", "api-server") not in kinds      # users reach the replicas through the router only
    assert ("PodDisruptionBudget", "router") in kinds and ("PodDisruptionBudget", "api-server") in kinds
    assert any(k == "NetworkPolicy" and n == "default-deny" for k, n in kinds)
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
    # mTLS: every pagedkv service pod mounts the CA; nodes are StatefulSets (per-ordinal certificates).
    for name, c in _service_containers():
        w = next(w for w in _workloads() if w["metadata"]["name"] == name)
        assert any(v.get("secret", {}).get("secretName") == "pagedkv-ca"
                   for v in w["spec"]["template"]["spec"]["volumes"]), name
        if c["command"][0] == "compute-node":
            assert w["kind"] == "StatefulSet", name


def _workload(name: str) -> dict[str, Any]:
    return next(w for w in _workloads() if w["metadata"]["name"] == name)


def test_fleet_mode_api_replicas_and_the_router_in_front() -> None:
    """Two API replicas, each a fleet member named after its pod and advertising its pod IP (the
    downward API); rollouts stop a replica before starting its successor (a surge pod would own no
    node and never get ready); readiness is /health (owned nodes / known engines), liveness only
    that the server answers. The router dials the block manager and forwards to the replicas."""
    api = _workload("api-server")
    assert api["spec"]["replicas"] == 2
    assert api["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    (c,) = api["spec"]["template"]["spec"]["containers"]
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
              if "fieldRef" in e.get("valueFrom", {})}
    assert fields == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    pod = "api-server-5d8f7c9b4-x2k8q"
    env = _env(c, pod)
    assert env["PAGEDKV_API_SCHEDULER_ID"] == pod
    assert env["PAGEDKV_API_ADVERTISE_URL"] == f"http://10.1.2.3:{env['PAGEDKV_API_PORT']}"
    assert "--no-fleet" not in c["command"] and "--block-manager" in c["command"]
    router = _workload("router")
    assert router["spec"]["replicas"] >= 1
    (r,) = router["spec"]["template"]["spec"]["containers"]
    assert r["command"][0] == "pagedkv-router"
    assert r["command"][r["command"].index("--block-manager") + 1] == "block-manager:50051"
    assert r["command"][r["command"].index("--model") + 1] == c["command"][c["command"].index("--model") + 1]
    for container in (c, r):
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"
        assert container["startupProbe"]["httpGet"]["path"] == "/metrics"
    key_ref = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in [*c["env"], *r["env"]]
               if "secretKeyRef" in e.get("valueFrom", {})}
    assert key_ref["PAGEDKV_ROUTER_API_KEY"] == key_ref["PAGEDKV_API_KEY"]


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
    proc = fork_server.run([sys.executable, "-c", code], text=True, timeout=120, cwd=ROOT)
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
        if name.endswith("METRICS_PORT") or name in ("PAGEDKV_API_PORT", "PAGEDKV_ROUTER_PORT"):
            ports.add(int(value))
        bound = re.fullmatch(r"tcp://(?:\*|[\w.-]+):(\d+)", value) if name.endswith("_ENDPOINT") else None
        if bound:   # a socket the service binds (the KV-event publisher's ZMQ endpoints)
            ports.add(int(bound.group(1)))
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
            for rule in d["spec"].get("egress", []):
                for peer in rule.get("to", []):
                    if "podSelector" in peer and "namespaceSelector" not in peer:   # a pod of these manifests
                        callees = selected(peer["podSelector"]["matchLabels"])
                        assert callees, (d["metadata"]["name"], peer)
                        for p in rule.get("ports", []):
                            assert any(_resolve(p["port"], c) for c in callees), (d["metadata"]["name"], p)


# ---- TLS: certificates as files, one per node ordinal ---------------------------------------

TLS_FILE_VARS = re.compile(r"^PAGEDKV_(CN_TLS__|TLS__|API_)(CERT_FILE|KEY_FILE|CA_FILE)$")


def _pod_names(workload: dict[str, Any]) -> list[str]:
    """The pod names a workload's pods get: a StatefulSet's ordinals (at least one, so a set
    declared with 0 replicas is checked too), a Deployment's random suffix."""
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(max(workload["spec"]["replicas"], 1))]
    return [f"{name}-5d8f7c9b4-x2k8q"]


def _declared_replicas(name: str) -> int:
    return max(next(w for w in _workloads() if w["metadata"]["name"] == name)["spec"]["replicas"], 1)


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/kubernetes/gen-certs.sh run for the ordinals the StatefulSets declare."""
    out = tmp_path_factory.mktemp("k8s-certs")
    env = {"PATH": "/usr/bin:/bin", "PAGEDKV_K8S_CPU_NODES": str(_declared_replicas("compute-node-cpu")),
           "PAGEDKV_K8S_GPU_NODES": str(_declared_replicas("compute-node-gpu"))}
    proc = subprocess.run(["bash", str(DEPLOY / "gen-certs.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def tls_secrets(cert_dir: Path) -> dict[str, dict[str, bytes]]:
    import base64

    docs = [d for d in yaml.safe_load_all((cert_dir / "tls-secrets.yaml").read_text()) if d]
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    return {d["metadata"]["name"]: {k: base64.b64decode(v) for k, v in (d.get("data") or {}).items()}
            for d in docs}


def _mounted_file(workload: dict[str, Any], c: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(Secret name, key) a file path of the container reads, or None when no Secret volume holds it."""
    parent, _, key = path.rpartition("/")
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for m in c.get("volumeMounts", []):
        if m["mountPath"].rstrip("/") == parent and "secret" in volumes.get(m["name"], {}):
            return volumes[m["name"]]["secret"]["secretName"], key
    return None


def tls_file_problems(secrets: dict[str, dict[str, bytes]]) -> list[str]:
    problems = []
    checked = 0
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            for pod in _pod_names(w):
                for name, value in _env(c, pod).items():
                    if not TLS_FILE_VARS.match(name):
                        continue
                    checked += 1
                    where = _mounted_file(w, c, value)
                    if where is None:
                        problems.append(f"{pod}: {name}={value} is in no mounted Secret volume")
                    elif where[1] not in secrets.get(where[0], {}):
                        problems.append(f"{pod}: {name}={value}: Secret {where[0]} has no key {where[1]!r}")
    if checked < 10:
        problems.append(f"only {checked} TLS file settings found")
    return problems


def test_every_tls_file_is_a_key_of_a_mounted_secret(tls_secrets: dict[str, dict[str, bytes]]) -> None:
    """Every certificate, key and CA path a TLS setting names, for every pod name the workloads
    get (each StatefulSet ordinal), is a key of the Secret mounted at that directory."""
    assert tls_file_problems(tls_secrets) == []


def test_tls_file_check_catches_a_missing_ordinal(tls_secrets: dict[str, dict[str, bytes]]) -> None:
    broken = {k: dict(v) for k, v in tls_secrets.items()}
    del broken["compute-node-cpu-tls"]["compute-node-cpu-1.key"]
    assert any("compute-node-cpu-1.key" in p for p in tls_file_problems(broken))


def _cert_identities(pem: bytes) -> tuple[list[str], list[str]]:
    """(SANs without their type, subject CNs) of a PEM certificate, as gRPC's auth context lists them."""
    text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-subject", "-nameopt", "multiline"],
                          input=pem, capture_output=True, timeout=30, check=True).stdout.decode()
    sans = re.findall(r"(?:DNS|URI|IP Address):([^,\s]+)", text)
    cns = re.findall(r"commonName\s*=\s*(.+)", text)
    return sans, [c.strip() for c in cns]


def _principal_of(pem: bytes) -> str:
    from pagedkv.auth import Authenticator, AuthSettings, Principal

    sans, cns = _cert_identities(pem)
    found = Authenticator(AuthSettings()).from_certificate({
        "transport_security_type": [b"ssl"], "x509_pem_cert": [pem],
        "x509_subject_alternative_name": [s.encode() for s in sans],
        "x509_common_name": [c.encode() for c in cns],
    })
    assert isinstance(found, Principal), found
    return str(found)


def _secret_file(w: dict[str, Any], c: dict[str, Any], pod: str, var: str,
                 secrets: dict[str, dict[str, bytes]]) -> bytes:
    where = _mounted_file(w, c, _env(c, pod)[var])
    assert where is not None, (pod, var)
    return secrets[where[0]][where[1]]


def test_certificates_name_the_identities_and_hosts_the_manifests_use(
    tls_secrets: dict[str, dict[str, bytes]], cert_dir: Path
) -> None:
    """Each pod presents the principal the access rules expect (node:<its node id>, scheduler)
    and its server certificate names the host its clients dial (and 127.0.0.1, the probe)."""
    ca = cert_dir / "ca.pem"
    assert tls_secrets["pagedkv-ca"]["ca.crt"] == ca.read_bytes()
    seen = set()
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            command = c.get("command", [""])[0]
            for pod in _pod_names(w):
                env = _env(c, pod)
                if command == "compute-node":
                    pem = _secret_file(w, c, pod, "PAGEDKV_CN_TLS__CERT_FILE", tls_secrets)
                    assert _principal_of(pem) == f"node:{env['PAGEDKV_CN_NODE_ID']}" == f"node:{pod}"
                    sans, _ = _cert_identities(pem)
                    assert env["PAGEDKV_CN_ADVERTISE_ADDRESS"].rsplit(":", 1)[0] in sans, (pod, sans)
                    assert "127.0.0.1" in sans
                    assert env["PAGEDKV_CN_BLOCK_MANAGER_ADDRESS"].rsplit(":", 1)[0] == "block-manager"
                elif command == "block-manager":
                    pem = _secret_file(w, c, pod, "PAGEDKV_TLS__CERT_FILE", tls_secrets)
                    sans, _ = _cert_identities(pem)
                    assert {"block-manager", "127.0.0.1"} <= set(sans), sans
                elif command == "pagedkv-serve":
                    pem = _secret_file(w, c, pod, "PAGEDKV_API_CERT_FILE", tls_secrets)
                    assert _principal_of(pem) == "scheduler"
                    assert c["command"][c["command"].index("--block-manager") + 1].startswith("block-manager:")
                elif command == "pagedkv-router":
                    pem = _secret_file(w, c, pod, "PAGEDKV_ROUTER_CERT_FILE", tls_secrets)
                    assert _principal_of(pem) == "scheduler:router"     # may Step only as "router": it never does
                    assert c["command"][c["command"].index("--block-manager") + 1].startswith("block-manager:")
                else:
                    continue
                seen.add(command)
                with_ca = subprocess.run(["openssl", "verify", "-CAfile", str(ca)], input=pem,
                                         capture_output=True, timeout=30)
                assert with_ca.returncode == 0, with_ca.stdout + with_ca.stderr
    assert seen == set(ENV_PREFIXES)


def test_headless_services_give_each_node_its_advertised_name() -> None:
    """A StatefulSet's pods get DNS names <pod>.<serviceName> only from a headless Service of that
    name selecting them; the nodes advertise exactly that name."""
    docs = _docs()
    for w in _workloads():
        if w["kind"] != "StatefulSet" or w["metadata"]["name"] == "postgres":
            continue
        name = w["metadata"]["name"]
        svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == w["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        (c,) = w["spec"]["template"]["spec"]["containers"]
        env = _env(c, f"{name}-0")
        assert env["PAGEDKV_CN_ADVERTISE_ADDRESS"] == f"{name}-0.{svc['metadata']['name']}.pagedkv.svc:50061"


def test_exec_probes_use_the_health_checks_flags_and_the_services_tls_prefix() -> None:
    """`python -m pagedkv.healthcheck` probes: every flag exists, and `--tls-env` names the prefix
    of the TLS settings the container sets (so the probe dials with the service's certificate)."""
    proc = subprocess.run([sys.executable, "-m", "pagedkv.healthcheck", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    flags = set(re.findall(r"(--[a-z][a-z0-9-]*)", proc.stdout))
    checked = 0
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                cmd = c.get(kind, {}).get("exec", {}).get("command", [])
                if cmd[:3] != ["python", "-m", "pagedkv.healthcheck"]:
                    continue
                assert {a for a in cmd if a.startswith("--")} <= flags, cmd
                prefix = cmd[cmd.index("--tls-env") + 1]
                tls_vars = [n for n in _env(c) if n.startswith(prefix) and n.endswith("CERT_FILE")]
                assert tls_vars, (w["metadata"]["name"], prefix)
                checked += 1
    assert checked >= 3


def test_the_tls_probe_passes_against_a_mutual_tls_server(cert_dir: Path, tmp_path: Path) -> None:
    """The readiness probe as the node's container runs it (its own env, --tls-env) against a real
    gRPC server on 127.0.0.1 serving the node's certificate and demanding client certificates."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    from pagedkv.tls import TlsSettings, server_credentials

    w = next(w for w in _workloads() if w["metadata"]["name"] == "compute-node-cpu")
    (c,) = w["spec"]["template"]["spec"]["containers"]
    env = _env(c, "compute-node-cpu-1")
    files = {"/etc/pagedkv/tls/node/compute-node-cpu-1.crt": cert_dir / "compute-node-cpu-1.pem",
             "/etc/pagedkv/tls/node/compute-node-cpu-1.key": cert_dir / "compute-node-cpu-1-key.pem",
             "/etc/pagedkv/tls/ca/ca.crt": cert_dir / "ca.pem"}
    probe_env = {k: str(files.get(v, v)) for k, v in env.items() if k.startswith("PAGEDKV_CN_TLS__")}
    assert len(probe_env) == 4
    tls = TlsSettings(cert_file=probe_env["PAGEDKV_CN_TLS__CERT_FILE"], key_file=probe_env["PAGEDKV_CN_TLS__KEY_FILE"],
                      ca_file=probe_env["PAGEDKV_CN_TLS__CA_FILE"], require_client_cert=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    server.start()
    try:
        cmd = c["readinessProbe"]["exec"]["command"]
        args = [a.replace("127.0.0.1:50061", f"127.0.0.1:{port}") for a in cmd[1:]]
        base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
        ok = subprocess.run([sys.executable, *args], env={**base, **probe_env}, capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        # Without the service's TLS settings the same probe cannot pass (it can fail).
        plain = subprocess.run([sys.executable, *args], env=base, capture_output=True, text=True, timeout=60,
                               cwd=tmp_path)
        assert plain.returncode != 0
    finally:
        server.stop(None)


def _tls_from_manifest(workload: str, pod: str, prefix: str, cert_dir: Path, **extra: Any) -> Any:
    """The TlsSettings a pod's container gets from its env, its Secret paths mapped onto the files
    gen-certs.sh wrote (`/etc/pagedkv/tls/node/<pod>.crt` -> `<pod>.pem`, ...)."""
    from pagedkv.tls import TlsSettings

    w = next(w for w in _workloads() if w["metadata"]["name"] == workload)
    (c,) = w["spec"]["template"]["spec"]["containers"]
    env = _env(c, pod)

    def local(path: str) -> Path:
        leaf = {"node": pod, "server": "block-manager", "client": "api-server", "router": "router"}
        directory, name = path.rsplit("/", 2)[1:]
        if directory == "ca":
            return cert_dir / "ca.pem"
        return cert_dir / (f"{leaf[directory]}-key.pem" if name.endswith(".key") else f"{leaf[directory]}.pem")

    return TlsSettings(cert_file=local(env[f"{prefix}CERT_FILE"]), key_file=local(env[f"{prefix}KEY_FILE"]),
                       ca_file=local(env[f"{prefix}CA_FILE"]), **extra)


async def test_a_node_pod_registers_as_itself_only_over_the_manifests_mtls(cert_dir: Path) -> None:
    """A real block manager with the manifest's TLS settings: pod compute-node-cpu-0, with the
    certificate its env names and dialling the name its env names, registers as node id
    compute-node-cpu-0 (its pod name); with ordinal 1's certificate it may not; the API server's
    certificate may Step but not register a node; the router's may Route, and neither Step nor
    join the fleet as another scheduler."""
    from block_manager.service.server import BlockManagerServer
    from pagedkv.tls import open_channel
    from pagedkv.v1 import block_manager_pb2 as pb
    from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
    from tests.block_manager.service.service_helpers import rid, service_config, step_request

    bm_tls = _tls_from_manifest("block-manager", "block-manager-5d8f7c9b4-x2k8q", "PAGEDKV_TLS__", cert_dir,
                                require_client_cert=True)
    server = BlockManagerServer(service_config(tls=bm_tls))
    await server.start()
    geometry = pb.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", device="cpu")

    def register(node_id: str) -> pb.RegisterNodeRequest:
        return pb.RegisterNodeRequest(request_id=rid("reg"), node_id=node_id, num_blocks=64, geometry=geometry,
                                      address=f"{node_id}.compute-node-cpu.pagedkv.svc:50061")

    async def code(tls: Any, method: str, request: Any) -> grpc.StatusCode:
        # Dial 127.0.0.1 but check the name the pods dial (block-manager:50051).
        async with open_channel(f"127.0.0.1:{server.port}", tls.model_copy(update={"server_name": "block-manager"}),
                                aio=True) as channel:
            try:
                await getattr(pb_grpc.BlockManagerStub(channel), method)(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    try:
        node0 = _tls_from_manifest("compute-node-cpu", "compute-node-cpu-0", "PAGEDKV_CN_TLS__", cert_dir)
        node1 = _tls_from_manifest("compute-node-cpu", "compute-node-cpu-1", "PAGEDKV_CN_TLS__", cert_dir)
        api = _tls_from_manifest("api-server", "api-server-5d8f7c9b4-x2k8q", "PAGEDKV_API_", cert_dir)
        router = _tls_from_manifest("router", "router-5d8f7c9b4-x2k8q", "PAGEDKV_ROUTER_", cert_dir)
        assert await code(node0, "RegisterNode", register("compute-node-cpu-0")) == grpc.StatusCode.OK
        assert await code(node1, "RegisterNode", register("compute-node-cpu-0")) == grpc.StatusCode.PERMISSION_DENIED
        assert await code(api, "RegisterNode", register("compute-node-cpu-0")) == grpc.StatusCode.PERMISSION_DENIED
        step = step_request(allocs=[("seq-0", "compute-node-cpu-0", list(range(10)), 0, None, 0)])
        assert await code(api, "Step", step) == grpc.StatusCode.OK
        # the router's certificate: Route, nothing that changes state
        assert await code(router, "Route", pb.RouteRequest(token_ids=[1, 2, 3])) == grpc.StatusCode.OK
        assert await code(router, "Step", step_request()) == grpc.StatusCode.PERMISSION_DENIED
        assert await code(router, "RegisterNode", register("compute-node-cpu-0")) == grpc.StatusCode.PERMISSION_DENIED
        heartbeat = pb.SchedulerHeartbeatRequest(scheduler_id="api-server-5d8f7c9b4-x2k8q", address="http://x:8000")
        assert await code(router, "SchedulerHeartbeat", heartbeat) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(0)
