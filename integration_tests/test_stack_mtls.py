"""The whole stack with mutual TLS (docker-compose.yml + docker-compose.mtls.yml, certificates
from scripts/gen-dev-certs.sh made in the test's temp dir): the mixed workload passes with every
call authenticated by certificate, the OpenAI server generates through the block manager and the
nodes with its scheduler certificate, and the stack refuses what it must.

One stack for the module, started without the API replicas and the router: the mixed workload's
scheduler is not a fleet member, and a replica joining the fleet owns the pools at once. The
OpenAI test starts a replica and the router and stops them (a graceful stop leaves the fleet and
hands the pools back), so each test leaves the stack as it found it and they pass in any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from block_manager.client import BlockManagerClient, PermissionDeniedError, UnavailableError
from block_manager.client.admin import AdminClient
from compute_node.client import ComputeNodeClient
from demo.localstack import MTLS_COMPOSE_FILE, LocalStack
from demo.serving import ServingDriver
from integration_tests.conftest import TEST_MODEL_NAME
from integration_tests.helpers import node_addresses, small_trace
from pagedkv.tls import open_channel
from tests.fixtures.certs import DevCerts, generate


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return generate(tmp_path_factory.mktemp("stack-certs"), nodes=("node-0", "node-1"))


@pytest.fixture(scope="module")
def mtls_stack(tmp_path_factory: pytest.TempPathFactory, certs: DevCerts,
               stack_env: dict[str, str]) -> Iterator[LocalStack]:
    env = {**stack_env, "PAGEDKV_CERTS_DIR": str(certs.dir)}
    stack = LocalStack(Path(tmp_path_factory.mktemp("mtls-stack")), interp_env=env,
                       override_files=[MTLS_COMPOSE_FILE])
    try:
        # health checks dial each service with its own certificate
        stack.up(["block-manager", "compute-node-0", "compute-node-1"])
        yield stack
    finally:
        stack.down()


def test_mixed_workload_with_mutual_tls(mtls_stack: LocalStack, certs: DevCerts) -> None:
    driver = ServingDriver(mtls_stack.address("block-manager"), node_addresses(mtls_stack), num_heads=4,
                           max_model_len=256, sample_every=2, seed=1, tls=certs.client("scheduler"),
                           admin_tls=certs.client("admin"))
    try:
        report = driver.run(small_trace(seed=1), defrag_at_step=20)
    finally:
        driver.close()
    assert report.checks > 0 and report.check_failures == 0, report.max_rel_error
    assert report.rejected == report.preempted == report.skipped == 0
    pools = report.final_status["pools"]
    assert sum(int(p.get("prefix_hit_tokens", 0)) for p in pools) > 0
    assert report.forks > 0 and sum(int(p.get("cow_copies", 0)) for p in pools) > 0
    assert report.defrag["trigger"] is not None
    with AdminClient(mtls_stack.address("block-manager"), tls=certs.client("admin"), timeout_s=20) as admin:
        assert admin.fsck().get("ok") is True
        assert admin.list_sequences().get("sequences", []) == []
        assert {n["node_id"] for n in admin.list_nodes()["nodes"]} == {"node-0", "node-1"}


def test_the_mtls_stack_refuses_plaintext_and_wrong_roles(mtls_stack: LocalStack, certs: DevCerts) -> None:
    bm = mtls_stack.address("block-manager")
    for service in ("block-manager", "compute-node-0"):
        with grpc.insecure_channel(mtls_stack.address(service)) as ch:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with BlockManagerClient(bm, tls=certs.client(None), timeout_s=10) as anonymous:
        with pytest.raises(UnavailableError):
            anonymous.route([1, 2, 3])
    with AdminClient(bm, tls=certs.client("scheduler"), timeout_s=10) as not_admin:
        with pytest.raises(PermissionDeniedError):
            not_admin.status()
    with BlockManagerClient(bm, tls=certs.client("compute-node-0"), timeout_s=10) as node0:
        with pytest.raises(PermissionDeniedError):
            node0.register_node("node-1", 16)                       # node-0's certificate as node-1
    with ComputeNodeClient(mtls_stack.address("compute-node-1"), tls=certs.client("compute-node-0")) as n1:
        with pytest.raises(grpc.RpcError) as err:
            n1.node_info()                                          # a node is no scheduler
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with open_channel(bm, certs.client("scheduler")) as ch:        # health needs only the handshake
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_openai_server_generates_over_mutual_tls(mtls_stack: LocalStack, certs: DevCerts) -> None:
    import httpx
    import openai

    assert mtls_stack.completed == {"model-init"}
    mtls_stack.start("api-server")   # healthy: it owns both nodes, and /health probes the block
    mtls_stack.start("router")       # manager and both nodes with its scheduler certificate
    url = "http://" + mtls_stack.address("router")   # the router routes with its own certificate
    assert httpx.get("http://" + mtls_stack.address("api-server") + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=TEST_MODEL_NAME, prompt=["a paged cache", "over mutual TLS"],
                                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    assert out.usage is not None and out.usage.completion_tokens == 12
    # a graceful stop frees what is left and hands the pools back for the other tests' scheduler
    assert mtls_stack.stop("router") == 0
    assert mtls_stack.stop("api-server") == 0
    with AdminClient(mtls_stack.address("block-manager"), tls=certs.client("admin"), timeout_s=20) as admin:
        assert not admin.list_sequences().get("sequences") and admin.fsck().get("ok") is True
