"""deploy/kubernetes/networkpolicies.yaml allows exactly the calls the system makes.

The call graph is derived, not listed by hand:
- **gRPC**: the services' access rules (`block_manager/service/access.py`,
  `compute_node/service/access.py`: every RPC of ours must have a rule there, or nobody may call
  it) are asked, for every method of every service in the generated protos and every principal
  role, whether that role may call it. A role reaches a service from the pods holding a
  credential of that role the service accepts: a client certificate (gen-certs.sh's, read back
  through the services' own certificate-to-principal mapping) or a token from the service's
  config (held by the pods that mount or reference the Secret carrying it). The callee's port is
  its listen address from its settings in the manifest.
- **the database**: `database_url` in the block manager's config, resolved to the Service and the
  pods it selects;
- **a narrow client**: a workload whose command only ever makes some calls (the router: Route)
  gets edges for those only, whatever else its credential would allow (`CLIENT_CALLS`, checked
  against the router's code);
- **HTTP**: the router forwards to the fleet's API replicas (every `pagedkv-serve` workload in
  fleet mode, at its `PAGEDKV_API_PORT`: the address each advertises is its pod IP);
- **metrics**: every pod's `prometheus.io/port`, scraped from the namespace `monitoring`;
- **the public face**: the router Service's port, from anywhere;
- **DNS**: every pod that dials anything, to kube-dns (port 53, UDP and TCP).

The policies are then evaluated with the NetworkPolicy rules (ingress of the callee AND egress
of the caller; pod and namespace selectors, `matchLabels` / `matchExpressions`, named and
numbered ports, protocols, ipBlocks) over every pod of the manifests plus outsiders (a pod in
`monitoring`, kube-dns, a stray pod in this namespace and in another, an address outside the
cluster), and the set of allowed connections must equal the derived graph: nothing the system
does is dropped, nothing else gets through.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from block_manager.service import access as bm_access
from block_manager.service.config import load_config as load_bm_config
from compute_node.service import access as cn_access
from compute_node.service.config import load_config as load_cn_config
from pagedkv.auth import ROLES, Principal
from pagedkv.v1 import block_manager_pb2, compute_node_pb2
from tests.deploy.test_kubernetes_manifests import (  # noqa: F401 (fixtures)
    _cert_identities,
    _docs,
    _env,
    _listen_ports,
    _mounted_file,
    _pod_names,
    _resolve,
    _workloads,
    cert_dir,
    tls_secrets,
)

NAMESPACE = "pagedkv"
PROTO_MODULES = (block_manager_pb2, compute_node_pb2)

# The gRPC servers among the manifests' commands: command -> (its access rule, the proto services
# it serves, the env var holding its listen address).
SERVERS: dict[str, tuple[Callable[[str, Principal, Any], str | None], tuple[str, ...], str]] = {
    "block-manager": (bm_access.authorize, ("pagedkv.v1.BlockManager", "pagedkv.v1.BlockManagerAdmin"),
                      "PAGEDKV_LISTEN_ADDRESS"),
    "compute-node": (cn_access.authorize, ("pagedkv.v1.ComputeNode",), "PAGEDKV_CN_LISTEN_ADDRESS"),
}


# Commands that only ever make these calls (service/method), whatever their credential allows:
# the router holds a scheduler certificate but only asks the block manager Route
# (test_the_routers_calls_are_the_ones_declared reads engine/api/router.py).
CLIENT_CALLS: dict[str, frozenset[str]] = {"pagedkv-router": frozenset({"BlockManager/Route"})}
PUBLIC_SERVICE = "router"


# ---- the endpoints: the manifests' pods and the outsiders -------------------------------------

@dataclass(frozen=True)
class Endpoint:
    name: str
    namespace: str | None           # None: not a pod (an address outside the cluster)
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    ports: dict[str, tuple[int, str]] = field(default_factory=dict, hash=False, compare=False)  # name -> (port, proto)
    listens: frozenset[tuple[int, str]] = frozenset()
    ip: str = "10.244.1.17"


def _container_ports(w: dict[str, Any]) -> tuple[dict[str, tuple[int, str]], frozenset[tuple[int, str]]]:
    named: dict[str, tuple[int, str]] = {}
    listens: set[tuple[int, str]] = set()
    for c in w["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            if "name" in p:
                named[p["name"]] = (int(p["containerPort"]), p.get("protocol", "TCP"))
        listens |= {(port, "TCP") for port in _listen_ports(c)}
    return named, frozenset(listens)


def pod_endpoints() -> dict[str, Endpoint]:
    out = {}
    for w in _workloads():
        named, listens = _container_ports(w)
        out[w["metadata"]["name"]] = Endpoint(w["metadata"]["name"], w["metadata"].get("namespace", NAMESPACE),
                                              dict(w["spec"]["template"]["metadata"]["labels"]), named, listens)
    return out


MONITORING = Endpoint("prometheus (namespace monitoring)", "monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")},
                    frozenset({(53, "UDP"), (53, "TCP")}))
STRAY_HERE = Endpoint("a stray pod in pagedkv", NAMESPACE, {"app": "debug"})
STRAY_ELSEWHERE = Endpoint("a pod in namespace default", "default", {"app.kubernetes.io/name": "api-server"})
OUTSIDE = Endpoint("203.0.113.7 (outside the cluster)", None, listens=frozenset({(443, "TCP"), (5432, "TCP")}),
                   ip="203.0.113.7")
OUTSIDERS = (MONITORING, KUBE_DNS, STRAY_HERE, STRAY_ELSEWHERE, OUTSIDE)


# ---- the call graph ---------------------------------------------------------------------------

Edge = tuple[str, str, int, str]   # (caller endpoint, callee endpoint, port, protocol)


def _request_as(method: Any, principal: Principal) -> Any:
    """The method's request, naming the caller where the rule compares ids (a node registers as
    itself, a scheduler steps as itself, a node pulls what was granted to it)."""
    request = getattr(_message_module(method.input_type), method.input_type.name)()
    for id_field in ("node_id", "scheduler_id", "dst_pool_id"):
        if id_field in method.input_type.fields_by_name:
            setattr(request, id_field, principal.name)
    return request


def _message_module(descriptor: Any) -> Any:
    return next(m for m in PROTO_MODULES if m.DESCRIPTOR.name == descriptor.file.name)


def proto_services() -> dict[str, Any]:
    return {s.full_name: s for m in PROTO_MODULES for s in m.DESCRIPTOR.services_by_name.values()}


def roles_allowed(command: str) -> dict[str, list[str]]:
    """role -> the methods of `command`'s services its access rule lets that role call."""
    authorize, services, _ = SERVERS[command]
    allowed: dict[str, list[str]] = {}
    for full_name in services:
        for method in proto_services()[full_name].methods:
            path = f"/{full_name}/{method.name}"
            for role in ROLES:
                principal = Principal(role, "compute-node-cpu-0" if role == "node" else "")
                if authorize(path, principal, _request_as(method, principal)) is None:
                    allowed.setdefault(role, []).append(f"{full_name.rsplit('.', 1)[1]}/{method.name}")
    return allowed


def _principal_of_cert(pem: bytes) -> Principal | None:
    from pagedkv.auth import Authenticator, AuthSettings

    sans, cns = _cert_identities(pem)
    found = Authenticator(AuthSettings()).from_certificate({
        "transport_security_type": [b"ssl"], "x509_pem_cert": [pem],
        "x509_subject_alternative_name": [s.encode() for s in sans],
        "x509_common_name": [c.encode() for c in cns],
    })
    return found if isinstance(found, Principal) else None


def _secrets_of(w: dict[str, Any], c: dict[str, Any]) -> set[str]:
    """Names of the Secrets a container can read: mounted volumes and env references."""
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
    names = {volumes[m["name"]]["secret"]["secretName"] for m in c.get("volumeMounts", [])
             if "secret" in volumes.get(m["name"], {})}
    names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
              if "secretKeyRef" in e.get("valueFrom", {})}
    return names


def _server_tokens(command: str, c: dict[str, Any], w: dict[str, Any], tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """principal role -> token the server `command` (container `c`) accepts, from its settings as
    the manifest configures them (env + the config file from its Secret)."""
    config_file = None
    if "--config" in c["command"]:
        path = c["command"][c["command"].index("--config") + 1]
        where = _mounted_file(w, c, path)
        assert where is not None, f"{w['metadata']['name']}: --config {path} is in no mounted Secret"
        secret = next(d for d in _docs() if d["kind"] == "Secret" and d["metadata"]["name"] == where[0])
        config_file = tmp_path / f"{w['metadata']['name']}.yaml"
        config_file.write_text(secret["stringData"][where[1]])
    with monkeypatch.context() as mp:
        for name, value in _env(c).items():
            mp.setenv(name, value)
        cfg = load_bm_config(config_file) if command == "block-manager" else load_cn_config(config_file)
    tokens = {p.partition(":")[0]: t for p, t in cfg.auth.tokens.items()}
    if getattr(cfg, "admin_token", None):
        tokens["admin"] = cfg.admin_token
    return tokens


def _holders_of_token(token: str) -> set[str]:
    """Workloads with a container that can read a Secret carrying `token`."""
    secrets = {d["metadata"]["name"] for d in _docs() if d["kind"] == "Secret"
               and any(token in str(v) for v in {**d.get("stringData", {}), **d.get("data", {})}.values())}
    return {w["metadata"]["name"] for w in _workloads()
            for c in w["spec"]["template"]["spec"]["containers"] if _secrets_of(w, c) & secrets}


@dataclass
class CallGraph:
    edges: dict[Edge, list[str]]          # edge -> why (the methods, the setting)
    public: set[tuple[str, int, str]]     # (callee, port, proto) open to anyone outside the namespace


def derive_call_graph(secrets: dict[str, dict[str, bytes]], tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> CallGraph:
    docs = _docs()
    pods = pod_endpoints()
    edges: dict[Edge, list[str]] = {}

    def add(src: str, dst: str, port: int, proto: str, why: str) -> None:
        edges.setdefault((src, dst, port, proto), []).append(why)

    # Client certificates: which principal each workload's certificate proves (every ordinal).
    cert_roles: dict[str, set[str]] = {}
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            for pod in _pod_names(w):
                for name, value in _env(c, pod).items():
                    if not name.endswith("CERT_FILE"):
                        continue
                    where = _mounted_file(w, c, value)
                    assert where is not None, f"{pod}: {name}={value} is in no mounted Secret"
                    principal = _principal_of_cert(secrets[where[0]][where[1]])
                    if principal is not None:
                        cert_roles.setdefault(w["metadata"]["name"], set()).add(principal.role)

    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            command = (c.get("command") or [""])[0]
            if command not in SERVERS:
                continue
            port = int(_env(c)[SERVERS[command][2]].rsplit(":", 1)[1])
            allowed = roles_allowed(command)
            holders = {role: {name for name, roles in cert_roles.items() if role in roles} for role in allowed}
            for role, token in _server_tokens(command, c, w, tmp_path, monkeypatch).items():
                holders.setdefault(role, set()).update(_holders_of_token(token))
            for role, methods in allowed.items():
                for caller in holders.get(role, ()):
                    calls = _client_calls(caller)
                    used = [m for m in methods if calls is None or m in calls]
                    if used:
                        add(caller, w["metadata"]["name"], port, "TCP", f"{role}: {', '.join(used)}")

    # HTTP: the router forwards to the fleet's API replicas (at the pod IPs they advertise).
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if (c.get("command") or [""])[0] != "pagedkv-router" or "--block-manager" not in c["command"]:
                continue
            for member, api_port in _fleet_members():
                add(w["metadata"]["name"], member, api_port, "TCP", "HTTP: forwarded OpenAI requests")

    # The database the block manager's config names.
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if (c.get("command") or [""])[0] != "block-manager":
                continue
            secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "block-manager-config")
            url = yaml.safe_load(secret["stringData"]["block-manager.yaml"])["database_url"]
            host, db_port = urlsplit(url).hostname, urlsplit(url).port or 5432
            svc = next((d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host), None)
            assert svc is not None, f"database_url host {host!r} is no Service of the manifests"
            for target in _selected_workloads(svc["spec"]["selector"]):
                add(w["metadata"]["name"], target, db_port, "TCP", f"database_url {host}:{db_port}")

    # Metrics scrapes.
    for w in _workloads():
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            add(MONITORING.name, w["metadata"]["name"], int(annotations["prometheus.io/port"]), "TCP", "metrics scrape")

    # The public face: the router Service.
    public = set()
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == PUBLIC_SERVICE)
    for target in _selected_workloads(svc["spec"]["selector"]):
        workload = next(w for w in _workloads() if w["metadata"]["name"] == target)
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        for p in svc["spec"]["ports"]:
            public.add((target, _resolve(p["targetPort"], c), p.get("protocol", "TCP")))

    # DNS: every pod that dials something resolves names first.
    for caller in {src for src, *_ in edges if src in pods}:
        for proto in ("UDP", "TCP"):
            add(caller, KUBE_DNS.name, 53, proto, "DNS")
    return CallGraph(edges, public)


def _client_calls(workload: str) -> frozenset[str] | None:
    """The calls a workload's containers make, when its command is a narrow client (else None)."""
    w = next(w for w in _workloads() if w["metadata"]["name"] == workload)
    commands = {(c.get("command") or [""])[0] for c in w["spec"]["template"]["spec"]["containers"]}
    narrow = [CLIENT_CALLS[c] for c in commands if c in CLIENT_CALLS]
    return frozenset().union(*narrow) if narrow and len(narrow) == len(commands) else None


def _fleet_members() -> list[tuple[str, int]]:
    """(workload, API port) of every `pagedkv-serve` container in fleet mode (with a block
    manager, without --no-fleet): the engines a router may forward to."""
    out = []
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            command = c.get("command") or [""]
            if command[0] == "pagedkv-serve" and "--block-manager" in command and "--no-fleet" not in command:
                out.append((w["metadata"]["name"], int(_env(c)["PAGEDKV_API_PORT"])))
    return out


def _selected_workloads(selector: dict[str, str]) -> list[str]:
    return [w["metadata"]["name"] for w in _workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


# ---- NetworkPolicy semantics ------------------------------------------------------------------

def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _peer_matches(peer: dict[str, Any], other: Endpoint, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if other.namespace is None:
        return False    # selectors select pods only
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": other.namespace}):
            return False
    elif other.namespace != policy_ns:
        return False
    return _selects(peer.get("podSelector"), other.labels)


def _port_matches(rule_ports: list[dict[str, Any]] | None, port: int, proto: str, target: Endpoint) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != proto:
            continue
        if "port" not in p:
            return True
        want = p["port"]
        if isinstance(want, str):
            if target.ports.get(want) == (port, proto):
                return True
        elif want <= port <= p.get("endPort", want):
            return True
    return False


def _policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def _direction_allows(policies: list[dict[str, Any]], direction: str, pod: Endpoint, other: Endpoint,
                      port: int, proto: str, target: Endpoint) -> bool:
    """Does `pod`'s side let the connection through in `direction` ("Ingress": `other` calls
    `pod`; "Egress": `pod` calls `other`)? `target` is the callee (named ports resolve on it)."""
    if pod.namespace is None:
        return True     # outside the cluster: not ours to police
    applying = [p for p in policies if p["metadata"].get("namespace", NAMESPACE) == pod.namespace
                and direction in _policy_types(p) and _selects(p["spec"]["podSelector"], pod.labels)]
    if not applying:
        return True
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for p in applying:
        for rule in p["spec"].get(key) or []:
            peers = rule.get(peers_key)
            ns = p["metadata"].get("namespace", NAMESPACE)
            if (not peers or any(_peer_matches(peer, other, ns) for peer in peers)) and \
                    _port_matches(rule.get("ports"), port, proto, target):
                return True
    return False


def allowed(policies: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int, proto: str) -> bool:
    return (_direction_allows(policies, "Egress", src, dst, port, proto, dst)
            and _direction_allows(policies, "Ingress", dst, src, port, proto, dst))


def policy_problems(policies: list[dict[str, Any]], graph: CallGraph) -> list[str]:
    """Every way the policies differ from the call graph, one line each."""
    endpoints = [*pod_endpoints().values(), *OUTSIDERS]
    by_name = {e.name: e for e in endpoints}
    problems = []
    for (src, dst, port, proto), why in sorted(graph.edges.items()):
        if not allowed(policies, by_name[src], by_name[dst], port, proto):
            problems.append(f"dropped: {src} -> {dst}:{port}/{proto} ({'; '.join(why)})")
    outside = [e for e in endpoints if e.namespace != NAMESPACE]   # our own pods: only their edges
    for dst, port, proto in sorted(graph.public):
        for src in outside:
            if not allowed(policies, src, by_name[dst], port, proto):
                problems.append(f"dropped: {src.name} -> {dst}:{port}/{proto} (the public face)")
    ours = set(pod_endpoints())
    for src in endpoints:
        for dst in endpoints:
            if src is dst or not ({src.name, dst.name} & ours):
                continue
            for port, proto in sorted(dst.listens):
                expected = (src.name, dst.name, port, proto) in graph.edges or (
                    src in outside and (dst.name, port, proto) in graph.public)
                if not expected and allowed(policies, src, dst, port, proto):
                    problems.append(f"allowed but never called: {src.name} -> {dst.name}:{port}/{proto}")
    return problems


def _policies() -> list[dict[str, Any]]:
    return [d for d in _docs() if d["kind"] == "NetworkPolicy"]


@pytest.fixture(scope="module")
def graph(tls_secrets: dict[str, dict[str, bytes]],  # noqa: F811 (the fixture imported above)
          tmp_path_factory: pytest.TempPathFactory) -> CallGraph:
    with pytest.MonkeyPatch.context() as mp:
        return derive_call_graph(tls_secrets, tmp_path_factory.mktemp("configs"), mp)


# ---- the checks -------------------------------------------------------------------------------

def test_every_grpc_service_has_a_server_in_the_manifests() -> None:
    """A new gRPC service must be placed in SERVERS (a server command, its access rule, its port)."""
    served = {s for _, services, _ in SERVERS.values() for s in services}
    assert set(proto_services()) == served


def test_the_call_graph_is_the_one_the_design_describes(graph: CallGraph) -> None:
    """The derivation finds the calls docs/kubernetes.md lists (it can fail: an access rule that
    no longer lets a role call, or a credential moved, changes this)."""
    def ports(src: str, dst: str) -> set[int]:
        return {p for (s, d, p, proto) in graph.edges if s == src and d == dst and proto == "TCP"}

    assert ports("api-server", "block-manager") == {50051}
    assert any("SchedulerHeartbeat" in w for w in graph.edges[("api-server", "block-manager", 50051, "TCP")])
    assert ports("api-server", "compute-node-cpu") == ports("api-server", "compute-node-gpu") == {50061}
    assert ports("compute-node-cpu", "block-manager") == {50051}
    assert ports("compute-node-cpu", "compute-node-gpu") == ports("compute-node-gpu", "compute-node-cpu") == {50061}
    assert any("FetchBlocks" in w for w in graph.edges[("compute-node-cpu", "compute-node-cpu", 50061, "TCP")])
    assert ports("block-manager", "postgres") == {5432}
    assert ports("block-manager", "block-manager") == {50051}      # the admin CLI in the pod, with the admin token
    assert ports("block-manager", "compute-node-cpu") == set()     # the block manager never calls a node
    # the router: Route at the block manager, the requests to the replicas; never a node
    assert ports("router", "block-manager") == {50051}
    assert graph.edges[("router", "block-manager", 50051, "TCP")] == ["scheduler: BlockManager/Route"]
    assert ports("router", "api-server") == {8000}
    assert ports("router", "compute-node-cpu") == ports("router", "compute-node-gpu") == set()
    assert {s for (s, d, *_) in graph.edges if d == "api-server"} == {"router", MONITORING.name}
    assert not any(d == "router" for (s, d, *_) in graph.edges if s != MONITORING.name)
    assert ports(MONITORING.name, "block-manager") == {9400}
    assert ports(MONITORING.name, "compute-node-gpu") == {9401}
    assert ports(MONITORING.name, "router") == ports(MONITORING.name, "api-server") == {8000}
    assert graph.public == {("router", 8000, "TCP")}
    assert ("postgres", KUBE_DNS.name, 53, "UDP") not in graph.edges       # postgres dials nothing


def idle_ports(endpoints: list[Endpoint], graph: CallGraph) -> list[tuple[str, int, str]]:
    called = {(d, p, proto) for (_, d, p, proto) in graph.edges} | graph.public
    return [(e.name, port, proto) for e in endpoints for port, proto in sorted(e.listens)
            if (e.name, port, proto) not in called]


def test_every_listening_port_is_called(graph: CallGraph) -> None:
    """A port a container listens on that nothing in the graph calls is a caller the derivation
    does not know (a new listener, a new kind of client): give it its edge. E.g. the block
    manager's ZMQ KV-event publisher (`PAGEDKV_KV_EVENTS__ZMQ_ENDPOINT`), if the manifests turn it
    on, needs its subscribers (a KV-aware router) in the graph and the policies."""
    assert idle_ports(list(pod_endpoints().values()), graph) == []
    bm = pod_endpoints()["block-manager"]
    with_zmq = Endpoint(bm.name, bm.namespace, bm.labels, bm.ports, bm.listens | {(5557, "TCP")})
    assert idle_ports([with_zmq], graph) == [("block-manager", 5557, "TCP")]


def test_the_routers_calls_are_the_ones_declared() -> None:
    """CLIENT_CALLS narrows the router's edges to Route: its code calls nothing else on its block
    manager client (a new call there must be declared, and the policies follow)."""
    source = (Path(__file__).resolve().parents[2] / "engine" / "api" / "router.py").read_text()
    called = set(re.findall(r"self\._bm\.(\w+)\(", source)) - {"close"}
    assert called == {"route"}
    assert {f"BlockManager/{name.title()}" for name in called} == CLIENT_CALLS["pagedkv-router"]


def test_the_network_policies_allow_exactly_the_call_graph(graph: CallGraph) -> None:
    problems = policy_problems(_policies(), graph)
    assert problems == [], "networkpolicies.yaml does not match the call graph:\n" + "\n".join(problems)


def test_the_policy_check_catches_a_dropped_and_an_extra_connection(graph: CallGraph) -> None:
    """The check above can fail both ways: without the node-to-node rule the prefix fetch is
    reported dropped; with the default egress deny gone, calls out of the cluster get through."""
    policies = yaml.safe_load(yaml.safe_dump(_policies()))
    node = next(p for p in policies if p["metadata"]["name"] == "compute-node")
    for rule in node["spec"]["ingress"]:
        rule["from"] = [peer for peer in rule["from"]
                        if peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
                        != "compute-node"]
    problems = policy_problems(policies, graph)
    assert any(p.startswith("dropped: compute-node-gpu -> compute-node-cpu:50061/TCP") and "FetchBlocks" in p
               for p in problems), problems

    open_egress = [p for p in yaml.safe_load(yaml.safe_dump(_policies()))]
    for p in open_egress:
        p["spec"]["policyTypes"] = [t for t in _policy_types(p) if t != "Egress"]
        p["spec"].pop("egress", None)
    problems = policy_problems(open_egress, graph)
    assert f"allowed but never called: api-server -> {OUTSIDE.name}:443/TCP" in problems, problems


def test_the_evaluator_follows_the_networkpolicy_rules() -> None:
    """The semantics the check relies on, on hand-made cases."""
    a = Endpoint("a", "ns1", {"role": "a"}, {"grpc": (50061, "TCP")}, frozenset({(50061, "TCP")}))
    b = Endpoint("b", "ns1", {"role": "b"})
    c = Endpoint("c", "ns2", {"role": "b"})

    def pol(spec: dict[str, Any], ns: str = "ns1") -> dict[str, Any]:
        return {"metadata": {"name": "p", "namespace": ns}, "spec": spec}

    assert allowed([], b, a, 50061, "TCP")                            # no policy: open
    deny = pol({"podSelector": {}, "policyTypes": ["Ingress"]})
    assert not allowed([deny], b, a, 50061, "TCP")
    from_b = pol({"podSelector": {"matchLabels": {"role": "a"}},
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "b"}}}],
                               "ports": [{"port": "grpc"}]}]})
    assert allowed([deny, from_b], b, a, 50061, "TCP")
    assert not allowed([deny, from_b], b, a, 50061, "UDP")            # protocol defaults to TCP
    assert not allowed([deny, from_b], c, a, 50061, "TCP")            # podSelector alone: same namespace only
    both = pol({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ns2"]}]},
        "podSelector": {"matchLabels": {"role": "b"}}}]}]})
    assert allowed([deny, both], c, a, 50061, "TCP") and not allowed([deny, both], b, a, 50061, "TCP")
    egress_deny = pol({"podSelector": {}, "policyTypes": ["Egress"]})
    assert not allowed([egress_deny], b, a, 50061, "TCP") and allowed([egress_deny], c, a, 50061, "TCP")
    ip = pol({"podSelector": {}, "policyTypes": ["Egress"],
              "egress": [{"to": [{"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.7/32"]}}]}]})
    assert not allowed([ip], b, OUTSIDE, 443, "TCP")
    assert allowed([ip], b, Endpoint("x", None, ip="203.0.113.8"), 443, "TCP")
    ranged = pol({"podSelector": {}, "ingress": [{"ports": [{"port": 50000, "endPort": 50100}]}]})
    assert allowed([ranged], c, a, 50061, "TCP") and not allowed([ranged], c, a, 50200, "TCP")
