"""Malformed requests to every RPC (bounded, seeded): the right status code, the server
stays healthy, and the state is exactly what it was (snapshot + status compare, fsck)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, rid

C = grpc.StatusCode
INVALID: set[C | None] = {C.INVALID_ARGUMENT}
ITEM: set[C | None] = {None}  # OK, with the failure reported per item (batched RPCs)
NUM_CASES = 240
NUM_RAW = 60


def _garbage_id(rng: random.Random) -> str:
    return rng.choice(["", " ", "x" * 300, "bad id", "\u00e9\u00e8", "a/b", "\t"])


def _bad_request_id(rng: random.Random) -> str:
    return rng.choice(["", "x" * 129, "tab\tid", "\u00e9t\u00e9"])


def _cases(rng: random.Random, epoch: int) -> list[tuple[str, str, Callable[[], Any], set[C | None]]]:
    """(service, method, request factory, allowed codes); every request is invalid."""
    g = lambda: _garbage_id(rng)  # noqa: E731
    item = lambda **kw: pb.AllocateItem(**{"seq_id": "fz", "pool_id": "n1", "num_tokens": 2, **kw})  # noqa: E731
    return [
        ("d", "RegisterNode", lambda: pb.RegisterNodeRequest(request_id=rid(), node_id=g(), num_blocks=8), INVALID),
        (
            "d",
            "RegisterNode",
            lambda: pb.RegisterNodeRequest(request_id=rid(), node_id="n9", num_blocks=rng.choice([0, 2**32 - 1])),
            INVALID,
        ),
        (
            "d",
            "RegisterNode",
            lambda: pb.RegisterNodeRequest(request_id=rid(), node_id="n9", num_blocks=8, block_size=2**32 - 1),
            INVALID,
        ),
        (
            "d",
            "RegisterNode",
            lambda: pb.RegisterNodeRequest(request_id=_bad_request_id(rng), node_id="n9", num_blocks=8),
            INVALID,
        ),
        ("d", "Heartbeat", lambda: pb.HeartbeatRequest(node_id="n1", epoch=0), INVALID),
        (
            "d",
            "Heartbeat",
            lambda: pb.HeartbeatRequest(node_id="n1", epoch=epoch + rng.randrange(1, 2**40)),
            {C.FAILED_PRECONDITION},
        ),
        ("d", "Heartbeat", lambda: pb.HeartbeatRequest(node_id=g(), epoch=1), {C.NOT_FOUND}),
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=rid()), INVALID),
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=_bad_request_id(rng), items=[item()]), INVALID),
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=rid(), items=[item(), item()]), INVALID),
        (
            "d",
            "Allocate",
            lambda: pb.AllocateRequest(request_id=rid(), items=[item(seq_id=rng.choice(["", "y" * 300]))]),
            INVALID,
        ),
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=rid(), items=[item(salt="s" * 2000)]), INVALID),
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=rid(), items=[item()], pool_epochs={"n1": 0}), INVALID),
        (
            "d",
            "Allocate",
            lambda: pb.AllocateRequest(request_id=rid(), items=[item()], pool_epochs={"n1": epoch + 3}),
            {C.FAILED_PRECONDITION},
        ),
        (
            "d",
            "Allocate",
            lambda: pb.AllocateRequest(request_id=rid(), items=[item()], pool_epochs={g() or "q": 1}),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        (
            "d",
            "Allocate",
            lambda: pb.AllocateRequest(request_id=rid(), items=[item(token_ids=[1, 2])]),
            ITEM,
        ),  # both given
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=rid(), items=[item(num_tokens=0)]), ITEM),  # neither
        (
            "d",
            "Allocate",
            lambda: pb.AllocateRequest(request_id=rid(), items=[item(pool_id=g() or "q")]),
            INVALID | ITEM,
        ),
        ("d", "Allocate", lambda: pb.AllocateRequest(request_id=rid(), items=[item(seq_id="live")]), ITEM),  # exists
        (
            "d",
            "Allocate",
            lambda: pb.AllocateRequest(request_id=rid(), items=[item(num_tokens=2**32 - 1)]),
            ITEM,
        ),  # too big
        ("d", "AppendSlots", lambda: pb.AppendSlotsRequest(request_id=rid()), INVALID),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(
                request_id=_bad_request_id(rng), items=[pb.AppendItem(seq_id="live", num_new_tokens=1)]
            ),
            INVALID,
        ),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(
                request_id=rid(), items=[pb.AppendItem(seq_id=rng.choice(["", "z" * 300]), num_new_tokens=1)]
            ),
            INVALID,
        ),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(request_id=rid(), items=[pb.AppendItem(seq_id="live", num_new_tokens=0)]),
            ITEM,
        ),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(
                request_id=rid(), items=[pb.AppendItem(seq_id="live", num_new_tokens=3, token_ids=[1])]
            ),
            ITEM,
        ),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(request_id=rid(), items=[pb.AppendItem(seq_id="ghost", num_new_tokens=1)]),
            ITEM,
        ),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(
                request_id=rid(), items=[pb.AppendItem(seq_id="live", num_new_tokens=2**32 - 1)]
            ),
            ITEM,
        ),
        (
            "d",
            "AppendSlots",
            lambda: pb.AppendSlotsRequest(
                request_id=rid(), items=[pb.AppendItem(seq_id="live", num_new_tokens=1)], pool_epochs={"n1": epoch + 1}
            ),
            {C.FAILED_PRECONDITION},
        ),
        (
            "d",
            "Fork",
            lambda: pb.ForkRequest(request_id=rid(), parent_seq_id=rng.choice(["", "p" * 300]), child_seq_ids=["k"]),
            INVALID,
        ),
        ("d", "Fork", lambda: pb.ForkRequest(request_id=rid(), parent_seq_id="live"), INVALID),
        (
            "d",
            "Fork",
            lambda: pb.ForkRequest(request_id=rid(), parent_seq_id="live", child_seq_ids=["k", "k"]),
            INVALID,
        ),
        (
            "d",
            "Fork",
            lambda: pb.ForkRequest(request_id=rid(), parent_seq_id="live", child_seq_ids=[rng.choice(["", "k" * 300])]),
            INVALID,
        ),
        (
            "d",
            "Fork",
            lambda: pb.ForkRequest(request_id=rid(), parent_seq_id="ghost", child_seq_ids=["k"]),
            {C.NOT_FOUND},
        ),
        (
            "d",
            "Fork",
            lambda: pb.ForkRequest(request_id=rid(), parent_seq_id="live", child_seq_ids=["k", "live"]),
            {C.ALREADY_EXISTS},
        ),
        (
            "d",
            "Fork",
            lambda: pb.ForkRequest(request_id=_bad_request_id(rng), parent_seq_id="live", child_seq_ids=["k"]),
            INVALID,
        ),
        ("d", "Free", lambda: pb.FreeRequest(request_id=rid()), INVALID),
        ("d", "Free", lambda: pb.FreeRequest(request_id=rid(), seq_ids=["live", "live"]), INVALID),
        ("d", "Free", lambda: pb.FreeRequest(request_id=rid(), seq_ids=["live", "ghost"]), {C.NOT_FOUND}),
        (
            "d",
            "Free",
            lambda: pb.FreeRequest(request_id=rid(), seq_ids=["live", g()]),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        ("d", "Free", lambda: pb.FreeRequest(request_id=_bad_request_id(rng), seq_ids=["live"]), INVALID),
        ("d", "GetTables", lambda: pb.GetTablesRequest(node_id="n1", epoch=0), INVALID),
        ("d", "GetTables", lambda: pb.GetTablesRequest(node_id="n1", epoch=epoch, seq_ids=["live", "live"]), INVALID),
        ("d", "GetTables", lambda: pb.GetTablesRequest(node_id="n1", epoch=epoch, seq_ids=["ghost"]), {C.NOT_FOUND}),
        (
            "d",
            "GetTables",
            lambda: pb.GetTablesRequest(node_id="n1", epoch=epoch, seq_ids=["live"], known_versions={"live": 2**60}),
            {C.ABORTED},
        ),
        ("d", "GetTables", lambda: pb.GetTablesRequest(node_id="n2", epoch=1, seq_ids=["live"]), INVALID),
        (
            "d",
            "AckCopyOps",
            lambda: pb.AckCopyOpsRequest(request_id=rid(), node_id="n1", epoch=0, up_to_op_id=1),
            INVALID,
        ),
        (
            "d",
            "AckCopyOps",
            lambda: pb.AckCopyOpsRequest(request_id=rid(), node_id="n1", epoch=epoch, up_to_op_id=2**63),
            INVALID,
        ),
        (
            "d",
            "AckCopyOps",
            lambda: pb.AckCopyOpsRequest(request_id=rid(), node_id=g() or "q", epoch=1),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        ("d", "PlanDefrag", lambda: pb.PlanDefragRequest(request_id=rid(), pool_id="n1", kind=g() or "x"), INVALID),
        (
            "d",
            "PlanDefrag",
            lambda: pb.PlanDefragRequest(request_id=rid(), pool_id=g() or "q"),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        ("d", "PlanDefrag", lambda: pb.PlanDefragRequest(request_id=_bad_request_id(rng), pool_id="n1"), INVALID),
        (
            "d",
            "CommitDefrag",
            lambda: pb.CommitDefragRequest(request_id=rid(), plan_id=rng.randrange(2**63)),
            {C.NOT_FOUND},
        ),
        (
            "d",
            "AbortDefrag",
            lambda: pb.AbortDefragRequest(request_id=rid(), plan_id=rng.randrange(2**63)),
            {C.NOT_FOUND},
        ),
        ("d", "Route", lambda: pb.RouteRequest(), INVALID),
        ("a", "ListSequences", lambda: pb.ListSequencesRequest(pool_id=g() or "q"), {C.NOT_FOUND, C.INVALID_ARGUMENT}),
        ("a", "DescribeSequence", lambda: pb.DescribeSequenceRequest(seq_id=rng.choice(["", "d" * 300])), INVALID),
        ("a", "DescribeSequence", lambda: pb.DescribeSequenceRequest(seq_id="ghost"), {C.NOT_FOUND}),
        (
            "a",
            "DrainNode",
            lambda: pb.DrainNodeRequest(request_id=rid(), node_id=g() or "q"),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        ("a", "DrainNode", lambda: pb.DrainNodeRequest(request_id=_bad_request_id(rng), node_id="n1"), INVALID),
        (
            "a",
            "ResetPrefixCache",
            lambda: pb.ResetPrefixCacheRequest(request_id=rid(), pool_id=g() or "q"),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        ("a", "TriggerDefrag", lambda: pb.TriggerDefragRequest(request_id=rid(), kind=g() or "x"), INVALID),
        (
            "a",
            "TriggerDefrag",
            lambda: pb.TriggerDefragRequest(request_id=rid(), pool_id=g() or "q"),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
    ]


async def _observable(h: Harness) -> tuple[dict, pb.StatusResponse]:
    status = await h.admin.Status(pb.StatusRequest())
    status.ClearField("uptime_s")
    return h.state_snapshot(), status


async def test_malformed_requests_every_rpc(harness: Harness) -> None:
    rng = random.Random(20261129)
    reg = await harness.register("n1", num_blocks=32)
    await harness.register("n2", num_blocks=8)
    await harness.allocate("live", tokens=[1, 2, 3, 4, 5])
    before = await _observable(harness)
    cases = _cases(rng, reg.epoch)
    methods = {(svc, m) for svc, m, _, _ in cases}
    # every RPC that takes input (Status, ListNodes and Fsck take none)
    all_methods = {m.name for svc in pb.DESCRIPTOR.services_by_name.values() for m in svc.methods}
    assert {m for _, m in methods} == all_methods - {"Status", "ListNodes", "Fsck"}
    for _ in range(NUM_CASES):
        svc, method, make, allowed = rng.choice(cases)
        request = make()
        stub = harness.stub if svc == "d" else harness.admin
        try:
            resp = await getattr(stub, method)(request, timeout=5)
        except grpc.aio.AioRpcError as err:
            assert err.code() in allowed, f"{method}({request}) -> {err.code().name}: {err.details()}"
        else:
            # only per-item failures may answer OK, and each item must carry its error
            assert None in allowed, f"{method}({request}) unexpectedly succeeded"
            assert all(o.WhichOneof("outcome") == "error" for o in resp.outcomes)
    assert await _observable(harness) == before
    assert await harness.fsck() == []


async def test_garbage_bytes_to_every_method(harness: Harness) -> None:
    rng = random.Random(7)
    await harness.register("n1", num_blocks=16)
    before = await _observable(harness)
    methods = [f"/pagedkv.v1.BlockManager/{m.name}" for m in pb.DESCRIPTOR.services_by_name["BlockManager"].methods]
    methods += [
        f"/pagedkv.v1.BlockManagerAdmin/{m.name}" for m in pb.DESCRIPTOR.services_by_name["BlockManagerAdmin"].methods
    ]
    for _ in range(NUM_RAW):
        method = rng.choice(methods)
        call = harness.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        try:
            await call(payload, timeout=5)
        except grpc.aio.AioRpcError as err:
            assert err.code() not in (C.UNKNOWN, C.INTERNAL), err.details()
    assert await _observable(harness) == before
    health = health_pb2_grpc.HealthStub(harness.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
