"""Security between hosts on the compute node (issue 14), real sockets and certificates.

The node accepts `Forward` only from scheduler principals (a Forward writes into its KV
memory), registers and heartbeats with the block manager over mutual TLS under the identity
in its own certificate, and cannot register under another node's id. A refused Forward
changes nothing: the scheduler's next Forward carries the same pool steps and applies cleanly.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from compute_node.service.server import ComputeNodeServer
from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc
from tests.compute_node.harness import Scheduler, cn_config, start_bm, start_node
from tests.fixtures.certs import DevCerts
from tests.support.polling import eventually

SCHED_TOKEN = "scheduler-token-0123456789abcdef"
NODE_TOKEN = "node-a-token-0123456789abcdef"


async def call_code(address: str, tls: TlsSettings | None, method: str, request: Any, token: str | None = None) -> Any:
    async with open_channel(address, tls, aio=True) as channel:
        try:
            return await getattr(pb_grpc.ComputeNodeStub(channel), method)(
                request, metadata=token_metadata(token), timeout=20)
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def test_mutual_tls_cluster_forwards_only_from_schedulers(dev_certs: DevCerts) -> None:
    bm = await start_bm(tls=dev_certs.server("block-manager"))
    node = await start_node(bm.address, tls=dev_certs.server("compute-node-a"))   # registered over mTLS
    s = Scheduler(bm.address, node.address, "node-a", tls=dev_certs.client("scheduler"))
    try:
        await s.forward([await s.allocate("a", list(range(9)))])
        step = await s.allocate("b", list(range(100, 107)))    # a new pool step for the node
        info_before = await call_code(node.address, dev_certs.client("admin"), "GetNodeInfo", pb.GetNodeInfoRequest())
        assert info_before.registered and info_before.num_cached_tables == 1
        request = s.request([step])      # carries the pending pool step and the prompt's K/V
        assert len(request.steps) == 1
        for who in ("compute-node-0", "admin", "block-manager"):
            code = await call_code(node.address, dev_certs.client(who), "Forward", request)
            assert code == grpc.StatusCode.PERMISSION_DENIED, who
        for tls in (None, dev_certs.client(None)):     # plaintext; TLS without a client certificate
            assert await call_code(node.address, tls, "Forward", request) == grpc.StatusCode.UNAVAILABLE
        info_after = await call_code(node.address, dev_certs.client("admin"), "GetNodeInfo", pb.GetNodeInfoRequest())
        assert info_after == info_before
        await s.forward([step])          # the scheduler's own Forward: the step applies once, outputs exact
        assert (await call_code(node.address, dev_certs.client("scheduler"), "GetNodeInfo",
                                pb.GetNodeInfoRequest())).last_step_id == info_before.last_step_id + 1
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_a_node_cannot_register_under_another_nodes_identity(dev_certs: DevCerts) -> None:
    bm = await start_bm(tls=dev_certs.server("block-manager"))
    impostor = ComputeNodeServer(cn_config(bm.address, node_id="node-1", tls=dev_certs.server("compute-node-0")))
    await impostor.start()
    try:
        failures = impostor.node.metrics.bm_failures.labels("RegisterNode")  # type: ignore[union-attr]
        await eventually(lambda: failures._value.get() >= 2, timeout_s=20, what="two refused registrations")
        assert impostor.node.registration is None  # type: ignore[union-attr]
        async with open_channel(bm.address, dev_certs.client("admin"), aio=True) as ch:
            from pagedkv.v1 import block_manager_pb2 as bm_pb
            from pagedkv.v1 import block_manager_pb2_grpc as bm_grpc

            nodes = await bm_grpc.BlockManagerAdminStub(ch).ListNodes(bm_pb.ListNodesRequest(), timeout=10)
        assert list(nodes.nodes) == []
    finally:
        await impostor.stop(0)
        await bm.stop(0)


async def test_bearer_tokens_between_scheduler_node_and_block_manager() -> None:
    bm = await start_bm(auth={"tokens": {"node:node-a": NODE_TOKEN, "scheduler": SCHED_TOKEN}})
    node = await start_node(bm.address, block_manager_token=NODE_TOKEN, auth={"tokens": {"scheduler": SCHED_TOKEN}})
    s = Scheduler(bm.address, node.address, "node-a", token=SCHED_TOKEN)
    try:
        step = await s.allocate("a", list(range(6)))
        request = s.request([step])
        assert await call_code(node.address, None, "Forward", request) == grpc.StatusCode.UNAUTHENTICATED
        assert await call_code(node.address, None, "Forward", request, NODE_TOKEN) == grpc.StatusCode.UNAUTHENTICATED
        assert await call_code(node.address, None, "GetNodeInfo", pb.GetNodeInfoRequest()) == \
            grpc.StatusCode.UNAUTHENTICATED
        await s.forward([step])
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_forward_step_count_is_capped(cluster: Any) -> None:  # type: ignore[no-untyped-def]
    step = await cluster.sched.allocate("a", list(range(5)))
    request = cluster.sched.request([step])
    first = request.steps[0]
    del request.steps[:]
    request.steps.extend([first] * 65)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.sched.node.Forward(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 64 pool steps" in err.value.details()
    await cluster.sched.forward([step])


@pytest.mark.parametrize(("method", "allowed"), [
    ("Forward", {"scheduler", "scheduler:s1"}),
    ("Generate", {"scheduler", "scheduler:s1"}),      # the model-level step writes KV memory too
    ("GetNodeInfo", {"scheduler", "scheduler:s1", "admin"}),
    ("Shutdown", set()),                              # an RPC without a rule: nobody
])
def test_compute_node_access_rules(method: str, allowed: set[str]) -> None:
    from compute_node.service.access import PREFIX, authorize
    from pagedkv.auth import parse_principal

    for who in ("scheduler", "scheduler:s1", "admin", "node:node-a"):
        refused = authorize(PREFIX + method, parse_principal(who), None)
        assert (refused is None) == (who in allowed), (method, who, refused)


def test_fetch_blocks_is_for_the_granted_node_only() -> None:
    """FetchBlocks: a node's principal, and only the node the request names as destination
    (the handler then checks that name against the grant's)."""
    from compute_node.service.access import PREFIX, authorize
    from pagedkv.auth import parse_principal
    from pagedkv.v1 import compute_node_pb2 as pb

    request = pb.FetchBlocksRequest(fetch_id="f", dst_pool_id="node-b")
    assert authorize(PREFIX + "FetchBlocks", parse_principal("node:node-b"), request) is None
    for who in ("node:node-a", "scheduler", "scheduler:node-b", "admin"):
        assert authorize(PREFIX + "FetchBlocks", parse_principal(who), request) is not None, who
