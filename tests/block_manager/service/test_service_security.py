"""Security between hosts on the block manager (issue 14), over real sockets with real
certificates (`tests/fixtures/certs.py`: the project's own dev-CA script, run at test time).

Transport: a plaintext client, a client certificate from another CA, no client certificate
under mutual TLS are all refused at the handshake. Identity: a node's certificate or token
acts only for its own node id, a scheduler's cannot register nodes or reach the admin plane,
only admin credentials reach the admin plane; every refused call changes nothing (fsck,
Status, nodes and sequences compared before and after). Limits: Route token ids, message sizes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from block_manager.service.server import BlockManagerServer
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import rid, service_config, step_request
from tests.fixtures.certs import DevCerts

TOKENS = {
    "admin": "admin-token-0123456789abcdef",
    "scheduler": "scheduler-token-0123456789abcdef",
    "scheduler:s1": "s1-token-0123456789abcdef",
    "node:node-0": "node0-token-0123456789abcdef",
    "node:node-1": "node1-token-0123456789abcdef",
}
GEOMETRY = pb.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", device="cpu")


def bearer(principal: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[principal]}"),)


def register_request(node: str) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(request_id=rid("reg"), node_id=node, num_blocks=64, geometry=GEOMETRY,
                                  address="127.0.0.1:1")


class Peer:
    """One client identity: its own channel (TLS settings) and call metadata (token)."""

    def __init__(self, port: int, tls: TlsSettings | None = None, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = open_channel(f"127.0.0.1:{port}", tls, aio=True)
        self.data = pb_grpc.BlockManagerStub(self.channel)
        self.admin = pb_grpc.BlockManagerAdminStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = metadata

    async def call(self, stub: Any, method: str, request: Any) -> Any:
        return await getattr(stub, method)(request, metadata=self.metadata, timeout=10)

    async def code(self, stub: Any, method: str, request: Any) -> grpc.StatusCode:
        """The status code of the call (OK when it succeeded)."""
        try:
            await self.call(stub, method, request)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Any]]:
    started: list[tuple[BlockManagerServer, list[Peer]]] = []

    async def start(**overrides: Any) -> tuple[BlockManagerServer, Callable[..., Peer]]:
        server = BlockManagerServer(service_config(**overrides))
        await server.start()
        peers: list[Peer] = []

        def peer(tls: TlsSettings | None = None, metadata: tuple[tuple[str, str], ...] = ()) -> Peer:
            p = Peer(server.port or 0, tls, metadata)
            peers.append(p)
            return p

        started.append((server, peers))
        return server, peer

    yield start
    for server, peers in started:
        for p in peers:
            await p.channel.close()
        await server.stop(0)


async def snapshot(admin: Peer) -> dict[str, Any]:
    """What a refused call must not change."""
    status = await admin.call(admin.admin, "Status", pb.StatusRequest())
    status.ClearField("uptime_s")
    nodes = await admin.call(admin.admin, "ListNodes", pb.ListNodesRequest())
    leases = {n.node_id: n.lease_remaining_s for n in nodes.nodes}
    for n in nodes.nodes:
        n.ClearField("lease_remaining_s")
    seqs = await admin.call(admin.admin, "ListSequences", pb.ListSequencesRequest())
    fsck = await admin.call(admin.admin, "Fsck", pb.FsckRequest())
    assert fsck.ok, list(fsck.problems)
    return {"status": status, "nodes": nodes, "seqs": seqs, "leases": leases}


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("status", "nodes", "seqs"):
        assert after[key] == before[key], key
    for node, remaining in after["leases"].items():   # no refused heartbeat renewed a lease
        assert remaining <= before["leases"][node]


# ---- transport --------------------------------------------------------------------------
async def test_mutual_tls_refuses_plaintext_foreign_ca_and_certificateless_clients(
    servers: Any, dev_certs: DevCerts, foreign_certs: DevCerts
) -> None:
    server, peer = await servers(tls=dev_certs.server("block-manager"))
    check = health_pb2.HealthCheckRequest()
    ok = peer(dev_certs.client("scheduler"))
    assert (await ok.call(ok.health, "Check", check)).status == health_pb2.HealthCheckResponse.SERVING
    refused = {
        "plaintext": peer(None),
        "client certificate from another CA": peer(TlsSettings(
            ca_file=dev_certs.ca, cert_file=foreign_certs.path("scheduler.pem"),
            key_file=foreign_certs.path("scheduler-key.pem"))),
        "no client certificate": peer(dev_certs.client(None)),
        "server not trusted (another CA's bundle)": peer(foreign_certs.client("scheduler")),
    }
    for what, p in refused.items():
        for stub, method, request in ((p.health, "Check", check), (p.admin, "Status", pb.StatusRequest()),
                                      (p.data, "RegisterNode", register_request("node-0"))):
            assert await p.code(stub, method, request) == grpc.StatusCode.UNAVAILABLE, f"{what}: {method}"
    admin = peer(dev_certs.client("admin"))
    assert (await snapshot(admin))["status"].num_nodes == 0     # nothing got through


async def test_server_only_tls_refuses_plaintext_and_serves_tls_clients(servers: Any, dev_certs: DevCerts) -> None:
    _, peer = await servers(tls=dev_certs.server("block-manager", require_client_cert=False))
    plain = peer(None)
    assert await plain.code(plain.health, "Check", health_pb2.HealthCheckRequest()) == grpc.StatusCode.UNAVAILABLE
    tls = peer(dev_certs.client(None))
    reply = await tls.call(tls.data, "RegisterNode", register_request("node-0"))   # no auth configured: dev mode
    assert reply.epoch == 1
    # the name checked in the server's certificate: dialling 127.0.0.1 as "block-manager" works,
    # as a name the certificate does not carry it does not
    named = peer(dev_certs.client(None, server_name="block-manager"))
    assert await named.code(named.health, "Check", health_pb2.HealthCheckRequest()) == grpc.StatusCode.OK
    wrong = peer(dev_certs.client(None, server_name="somewhere-else"))
    assert await wrong.code(wrong.health, "Check", health_pb2.HealthCheckRequest()) == grpc.StatusCode.UNAVAILABLE


# ---- identity: certificates ---------------------------------------------------------------
async def test_certificates_act_only_as_their_principal_and_refusals_change_nothing(
    servers: Any, dev_certs: DevCerts
) -> None:
    _, peer = await servers(tls=dev_certs.server("block-manager"))
    node0, node1 = peer(dev_certs.client("compute-node-0")), peer(dev_certs.client("compute-node-1"))
    sched, admin = peer(dev_certs.client("scheduler")), peer(dev_certs.client("admin"))
    reg0 = await node0.call(node0.data, "RegisterNode", register_request("node-0"))
    reg1 = await node1.call(node1.data, "RegisterNode", register_request("node-1"))
    step = await sched.call(sched.data, "Step", step_request(
        scheduler_id="any", allocs=[("seq-0", "node-0", list(range(10)), 0, None, 0)]))
    assert not step.errors
    before = await snapshot(admin)

    denied = grpc.StatusCode.PERMISSION_DENIED
    heartbeat1 = pb.HeartbeatRequest(node_id="node-1", epoch=reg1.epoch)
    tables1 = pb.GetTablesRequest(node_id="node-1", epoch=reg1.epoch, seq_ids=[])
    attempts = [
        (node0, node0.data, "RegisterNode", register_request("node-1")),      # node A as node B
        (node0, node0.data, "Heartbeat", heartbeat1),
        (node0, node0.data, "GetTables", tables1),
        (node0, node0.data, "Step", step_request(frees=["seq-0"])),           # a node is no scheduler
        (node0, node0.admin, "Status", pb.StatusRequest()),
        (sched, sched.data, "RegisterNode", register_request("node-2")),      # a scheduler registers no node
        (sched, sched.data, "Heartbeat", heartbeat1),
        (sched, sched.admin, "Status", pb.StatusRequest()),                   # ... nor reaches the admin plane
        (sched, sched.admin, "DrainNode", pb.DrainNodeRequest(request_id=rid("d"), node_id="node-0")),
        (sched, sched.admin, "ResetPrefixCache", pb.ResetPrefixCacheRequest(request_id=rid("r"))),
        (admin, admin.data, "Step", step_request(frees=["seq-0"])),           # admin is no scheduler
        (admin, admin.data, "RegisterNode", register_request("node-3")),
    ]
    for p, stub, method, request in attempts:
        assert await p.code(stub, method, request) == denied, method
    assert_unchanged(before, await snapshot(admin))

    # ... while each does its own job
    beat = await node0.call(node0.data, "Heartbeat", pb.HeartbeatRequest(node_id="node-0", epoch=reg0.epoch))
    assert beat.lease_ttl_s > 0
    assert (await node1.call(node1.data, "GetTables", tables1)).last_step_id >= 0
    assert (await sched.call(sched.data, "Route", pb.RouteRequest(token_ids=[1, 2, 3]))).entries
    assert not (await sched.call(sched.data, "Step", step_request(scheduler_id="any", frees=["seq-0"]))).errors


async def test_explicit_certificate_mapping_and_unmapped_certificates(servers: Any, dev_certs: DevCerts) -> None:
    """An operator's PKI without SPIFFE URIs: subject CN / DNS SANs mapped to principals; a
    certificate of the right CA that maps to nothing is refused."""
    auth = {"cert_uri_prefix": "", "cert_principals": {"compute-node-1": "node:node-1", "admin": "admin"}}
    _, peer = await servers(tls=dev_certs.server("block-manager"), auth=auth)
    node1, node0 = peer(dev_certs.client("compute-node-1")), peer(dev_certs.client("compute-node-0"))
    admin = peer(dev_certs.client("admin"))
    assert (await node1.call(node1.data, "RegisterNode", register_request("node-1"))).epoch == 1
    assert await node0.code(node0.data, "RegisterNode", register_request("node-0")) == grpc.StatusCode.PERMISSION_DENIED
    assert await node1.code(node1.data, "RegisterNode", register_request("node-0")) == grpc.StatusCode.PERMISSION_DENIED
    assert (await snapshot(admin))["status"].num_nodes == 1


# ---- identity: bearer tokens -------------------------------------------------------------------
async def test_role_tokens_without_mtls(servers: Any, dev_certs: DevCerts) -> None:
    _, peer = await servers(tls=dev_certs.server("block-manager", require_client_cert=False), auth={"tokens": TOKENS})
    tls = dev_certs.client(None)
    node0, node1 = peer(tls, bearer("node:node-0")), peer(tls, bearer("node:node-1"))
    sched, s1, admin = peer(tls, bearer("scheduler")), peer(tls, bearer("scheduler:s1")), peer(tls, bearer("admin"))
    nobody, forger = peer(tls), peer(tls, (("authorization", "Bearer not-a-token-0123456789"),))
    reg1 = await node1.call(node1.data, "RegisterNode", register_request("node-1"))
    before = await snapshot(admin)

    unauthenticated, denied = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    attempts = [
        (nobody, nobody.data, "RegisterNode", register_request("node-0"), unauthenticated),
        (nobody, nobody.data, "Step", step_request(frees=["x"]), unauthenticated),
        (nobody, nobody.admin, "Status", pb.StatusRequest(), unauthenticated),
        (forger, forger.data, "Route", pb.RouteRequest(token_ids=[1]), unauthenticated),
        (node0, node0.data, "RegisterNode", register_request("node-1"), denied),
        (node0, node0.data, "Heartbeat", pb.HeartbeatRequest(node_id="node-1", epoch=reg1.epoch), denied),
        (sched, sched.data, "RegisterNode", register_request("node-0"), denied),
        (sched, sched.admin, "Fsck", pb.FsckRequest(), denied),
        (s1, s1.data, "Step", step_request(scheduler_id="s2", frees=["x"]), denied),   # bound to its id
        (admin, admin.data, "Route", pb.RouteRequest(token_ids=[1]), denied),
    ]
    for p, stub, method, request, code in attempts:
        assert await p.code(stub, method, request) == code, method
    assert_unchanged(before, await snapshot(admin))

    health = await nobody.call(nobody.health, "Check", health_pb2.HealthCheckRequest())   # probes stay open
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert (await node0.call(node0.data, "RegisterNode", register_request("node-0"))).epoch == 1
    assert not (await s1.call(s1.data, "Step", step_request(scheduler_id="s1", release=True))).errors
    assert not (await sched.call(sched.data, "Step", step_request(scheduler_id="s9", release=True))).errors


async def test_legacy_admin_token_joins_the_role_tokens(servers: Any) -> None:
    _, peer = await servers(auth={"tokens": {"scheduler": TOKENS["scheduler"]}}, admin_token="legacy")
    admin = peer(None, (("authorization", "Bearer legacy"),))
    sched = peer(None, bearer("scheduler"))
    assert (await admin.call(admin.admin, "Status", pb.StatusRequest())).state == "serving"
    assert await admin.code(admin.data, "Route", pb.RouteRequest(token_ids=[1])) == grpc.StatusCode.PERMISSION_DENIED
    assert await sched.code(sched.admin, "Status", pb.StatusRequest()) == grpc.StatusCode.PERMISSION_DENIED


async def test_no_auth_configured_is_development_mode(servers: Any) -> None:
    _, peer = await servers()
    anyone = peer(None)
    assert (await anyone.call(anyone.data, "RegisterNode", register_request("node-0"))).epoch == 1
    assert (await anyone.call(anyone.admin, "Status", pb.StatusRequest())).num_nodes == 1


# ---- limits -------------------------------------------------------------------------------------
async def test_route_token_cap_and_message_size_limit(servers: Any) -> None:
    _, peer = await servers(max_route_tokens=1000, max_message_bytes=1 << 20)
    p = peer(None)
    await p.call(p.data, "RegisterNode", register_request("node-0"))
    assert len((await p.call(p.data, "Route", pb.RouteRequest(token_ids=list(range(1000))))).entries) == 1
    assert await p.code(p.data, "Route", pb.RouteRequest(token_ids=list(range(1001)))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    # ~1.2 MB of token ids: refused by the transport before it is parsed
    big = pb.RouteRequest(token_ids=[100_000] * 400_000)
    assert big.ByteSize() > 1 << 20
    assert await p.code(p.data, "Route", big) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await p.call(p.admin, "Fsck", pb.FsckRequest())).ok


async def test_a_million_token_route_is_refused_by_default(servers: Any) -> None:
    _, peer = await servers()
    p = peer(None)
    await p.call(p.data, "RegisterNode", register_request("node-0"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await p.call(p.data, "Route", pb.RouteRequest(token_ids=[7] * 1_000_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 131072 token ids" in (err.value.details() or "")


# ---- operator tools: health check and admin CLI take the same options ----------------------------
async def test_healthcheck_and_admin_cli_over_mutual_tls(
    servers: Any, dev_certs: DevCerts, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from block_manager.cli import admin as admin_cli
    from pagedkv import healthcheck

    server, _ = await servers(tls=dev_certs.server("block-manager"))
    target = f"127.0.0.1:{server.port}"

    def run(fn: Any, *argv: str) -> int:
        return fn(list(argv))

    admin_files = ["--ca-file", str(dev_certs.ca), "--cert-file", str(dev_certs.path("admin.pem")),
                   "--key-file", str(dev_certs.path("admin-key.pem"))]
    assert await asyncio.to_thread(run, healthcheck.main, target, *admin_files) == 0
    assert await asyncio.to_thread(run, healthcheck.main, target) == 1                     # plaintext: refused
    monkeypatch.setenv("PAGEDKV_TLS__CA_FILE", str(dev_certs.ca))                           # the service's own env
    monkeypatch.setenv("PAGEDKV_TLS__CERT_FILE", str(dev_certs.path("block-manager.pem")))
    monkeypatch.setenv("PAGEDKV_TLS__KEY_FILE", str(dev_certs.path("block-manager-key.pem")))
    assert await asyncio.to_thread(run, healthcheck.main, target, "--tls-env", "PAGEDKV_TLS__") == 0
    out = capsys.readouterr().out.split()
    assert out == ["SERVING", "UNREACHABLE", "SERVING"]

    assert await asyncio.to_thread(run, admin_cli.main, "--target", target, "--json", "status", *admin_files) == 0
    assert '"state": "serving"' in capsys.readouterr().out
    code = await asyncio.to_thread(run, admin_cli.main, "--target", target, "status")
    assert code == admin_cli.EXIT_UNREACHABLE and "--ca-file" in capsys.readouterr().err
    sched_files = ["--ca-file", str(dev_certs.ca), "--cert-file", str(dev_certs.path("scheduler.pem")),
                   "--key-file", str(dev_certs.path("scheduler-key.pem"))]
    code = await asyncio.to_thread(run, admin_cli.main, "--target", target, "fsck", *sched_files)
    assert code == admin_cli.EXIT_REFUSED and "permission denied" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDKV_ADMIN_CA_FILE", str(dev_certs.path("admin-key.pem")))      # not a certificate
    code = await asyncio.to_thread(run, admin_cli.main, "--target", target, "status")
    assert code == admin_cli.EXIT_USAGE and "not a PEM file" in capsys.readouterr().err


def test_security_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, dev_certs: DevCerts) -> None:
    """What an operator writes in a container's environment (JSON for mappings)."""
    import json

    from block_manager.service.config import load_config
    from compute_node.service.config import load_config as load_cn
    from pagedkv.settings import ConfigError

    monkeypatch.setenv("PAGEDKV_TLS__CERT_FILE", str(dev_certs.path("block-manager.pem")))
    monkeypatch.setenv("PAGEDKV_TLS__KEY_FILE", str(dev_certs.path("block-manager-key.pem")))
    monkeypatch.setenv("PAGEDKV_AUTH__TOKENS", json.dumps({"node:node-0": TOKENS["node:node-0"]}))
    monkeypatch.setenv("PAGEDKV_MAX_ROUTE_TOKENS", "4096")
    cfg = load_config()
    assert cfg.tls.active and not cfg.tls.require_client_cert and cfg.auth_enabled
    assert cfg.auth.tokens == {"node:node-0": TOKENS["node:node-0"]} and cfg.max_route_tokens == 4096
    monkeypatch.setenv("PAGEDKV_TLS__REQUIRE_CLIENT_CERT", "true")          # without a CA
    with pytest.raises(ConfigError, match="require_client_cert needs ca_file"):
        load_config()
    monkeypatch.delenv("PAGEDKV_TLS__REQUIRE_CLIENT_CERT")
    monkeypatch.setenv("PAGEDKV_AUTH__TOKENS", json.dumps({"node:node-0": "short"}))
    with pytest.raises(ConfigError, match="at least 16"):
        load_config()
    monkeypatch.setenv("PAGEDKV_AUTH__TOKENS", "{}")
    monkeypatch.setenv("PAGEDKV_AUTH__ENABLED", "true")                      # on, but nobody could call
    with pytest.raises(ConfigError, match="nobody could call"):
        load_config()
    monkeypatch.setenv("PAGEDKV_CN_BLOCK_MANAGER_TOKEN", TOKENS["node:node-0"])
    monkeypatch.setenv("PAGEDKV_CN_AUTH__CERT_PRINCIPALS", json.dumps({"sched.example.com": "scheduler"}))
    cn = load_cn()
    assert cn.block_manager_token == TOKENS["node:node-0"] and not cn.auth_enabled
    assert cn.auth.cert_principals == {"sched.example.com": "scheduler"}


async def test_item_caps_on_tables_and_route(servers: Any) -> None:
    _, peer = await servers(max_batch=8)
    p = peer(None)
    reg = await p.call(p.data, "RegisterNode", register_request("node-0"))
    many = pb.GetTablesRequest(node_id="node-0", epoch=reg.epoch, known_versions={f"s{i}": 1 for i in range(9)})
    assert await p.code(p.data, "GetTables", many) == grpc.StatusCode.INVALID_ARGUMENT
    salts = pb.RouteRequest(token_ids=[1], num_token_ids=[1], salts=[f"t{i}" for i in range(9)])
    assert await p.code(p.data, "Route", salts) == grpc.StatusCode.INVALID_ARGUMENT
    assert await p.code(p.data, "Route", pb.RouteRequest(token_ids=[1], num_token_ids=[1], salts=["t"])) == \
        grpc.StatusCode.OK
