"""Malformed requests to every RPC (bounded, seeded): the right status code, the server
stays healthy, and the state is exactly what it was (snapshot + status compare, fsck)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, rid, service_config, step_request

C = grpc.StatusCode
INVALID: set[C | None] = {C.INVALID_ARGUMENT}
ITEM: set[C | None] = {None}  # OK, with the failure reported per item (batched RPCs)
NUM_CASES = 240
NUM_RAW = 60
MAX_BATCH = service_config().max_batch


def _garbage_id(rng: random.Random) -> str:
    return rng.choice(["", " ", "x" * 300, "bad id", "\u00e9\u00e8", "a/b", "\t"])


def _bad_request_id(rng: random.Random) -> str:
    return rng.choice(["", "x" * 129, "tab\tid", "\u00e9t\u00e9"])


def _skewed_alloc(rng: random.Random) -> pb.StepRequest:
    """An allocation whose parallel columns disagree (one column short, an index out of range,
    or token ids that do not add up to the counts)."""
    m = step_request(allocs=[("fz", "n1", [1, 2, 3], 0, "s", 0)])
    broken = rng.choice(["pool_index", "salt_index", "num_tokens", "token_ids", "pool_range", "salt_range"])
    if broken == "pool_index":
        m.ClearField("alloc_pool_index")
    elif broken == "salt_index":
        m.alloc_salt_index.append(-1)
    elif broken == "num_tokens":
        m.alloc_num_tokens.append(4)
    elif broken == "token_ids":
        m.alloc_token_ids.append(9)
    elif broken == "pool_range":
        m.alloc_pool_index[0] = 5
    else:
        m.alloc_salt_index[0] = rng.choice([1, -2])
    return m


def _skewed_fork(rng: random.Random) -> pb.StepRequest:
    m = step_request(forks=[("live", ["k1", "k2"])])
    if rng.random() < 0.5:
        m.fork_num_children[0] = 3
    else:
        m.fork_num_children.append(1)
    return m


def _cases(rng: random.Random, epoch: int) -> list[tuple[str, str, Callable[[], Any], set[C | None]]]:
    """(service, method, request factory, allowed codes); every request is invalid."""
    g = lambda: _garbage_id(rng)  # noqa: E731
    step = step_request

    def alloc(seq_id: str = "fz", pool_id: str = "n1", num_tokens: int = 2, salt: str | None = None) -> tuple:
        return (seq_id, pool_id, None, num_tokens, salt, 0)

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
        ("d", "Step", lambda: pb.StepRequest(request_id=rid()), INVALID),  # no scheduler id
        ("d", "Step", lambda: step(scheduler_id=rng.choice(["s" * 200, "t\u00e9", "tab\tid"])), INVALID),
        ("d", "Step", lambda: step(request_id=_bad_request_id(rng), appends=[("live", 1)]), INVALID),
        ("d", "Step", lambda: step(scheduler_id="intruder", appends=[("live", 1)]), {C.FAILED_PRECONDITION}),
        ("d", "Step", lambda: step(allocs=[alloc(), alloc()]), INVALID),  # same seq twice
        ("d", "Step", lambda: step(allocs=[alloc(seq_id=rng.choice(["", "y" * 300]))]), INVALID),
        ("d", "Step", lambda: step(allocs=[alloc(salt="s" * 2000)]), INVALID),
        ("d", "Step", lambda: step(allocs=[alloc()], pool_epochs={"n1": 0}), INVALID),
        ("d", "Step", lambda: step(allocs=[alloc()], pool_epochs={"n1": epoch + 3}), {C.FAILED_PRECONDITION}),
        (
            "d",
            "Step",
            lambda: step(allocs=[alloc()], pool_epochs={g() or "q": 1}),
            {C.NOT_FOUND, C.INVALID_ARGUMENT},
        ),
        ("d", "Step", lambda: _skewed_alloc(rng), INVALID),  # columns that disagree
        ("d", "Step", lambda: step(allocs=[alloc(num_tokens=0)]), INVALID),  # neither ids nor count
        ("d", "Step", lambda: step(allocs=[alloc(pool_id=g() or "q")]), INVALID | ITEM),
        ("d", "Step", lambda: step(allocs=[alloc(seq_id="live")]), ITEM),  # exists
        ("d", "Step", lambda: step(allocs=[alloc(num_tokens=2**32 - 1)]), ITEM),  # too big
        ("d", "Step", lambda: step(appends=[("live", 1), ("live", 1)]), INVALID),
        ("d", "Step", lambda: step(appends=[(rng.choice(["", "z" * 300]), 1)]), INVALID),
        ("d", "Step", lambda: step(appends=[("live", 0)]), INVALID),
        ("d", "Step", lambda: step(appends=[("live", 3, [1])]), INVALID),  # 1 token id for 3 tokens
        ("d", "Step", lambda: step(appends=[("ghost", 1)]), ITEM),
        ("d", "Step", lambda: step(appends=[("live", 2**32 - 1)]), ITEM),
        ("d", "Step", lambda: step(appends=[("live", 1)], pool_epochs={"n1": epoch + 1}), {C.FAILED_PRECONDITION}),
        ("d", "Step", lambda: step(written=[("live", rng.choice([64, 2**31]))]), ITEM),  # past the block
        ("d", "Step", lambda: step(forks=[(rng.choice(["", "p" * 300]), ["k"])]), INVALID),
        ("d", "Step", lambda: step(forks=[("live", ["k", "k"])]), INVALID),
        ("d", "Step", lambda: step(forks=[("live", [rng.choice(["", "k" * 300])])]), INVALID),
        ("d", "Step", lambda: _skewed_fork(rng), INVALID),
        ("d", "Step", lambda: step(forks=[("ghost", ["k"])]), ITEM),
        ("d", "Step", lambda: step(forks=[("live", ["k", "live"])]), ITEM),
        ("d", "Step", lambda: step(frees=["live", "live"]), INVALID),
        ("d", "Step", lambda: step(frees=["live", "ghost"]), {C.NOT_FOUND}),
        ("d", "Step", lambda: step(frees=["live", g()]), {C.NOT_FOUND, C.INVALID_ARGUMENT}),
        ("d", "Step", lambda: step(reports={"n1": (epoch, 2**40, 0)}), {C.FAILED_PRECONDITION}),  # never handed out
        (
            "d",
            "Step",
            lambda: step(reports={"n1": (epoch, 0, rng.choice([3, 2**40]))}),
            INVALID | {C.FAILED_PRECONDITION},
        ),
        ("d", "Step", lambda: step(reports={g() or "q": (1, 0, 0)}), INVALID | ITEM),
        ("d", "Step", lambda: step(appends=[(f"s{i}", 1) for i in range(MAX_BATCH + 1)]), INVALID),
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
        ("d", "OpenSession", lambda: pb.OpenSessionRequest(client_name=rng.choice(["x" * 129, "bad\nname"])), INVALID),
        (
            "d",
            "Step",
            lambda: pb.StepRequest(
                request_id=rid(), scheduler_id="s",
                session=pb.ClientSession(session_id=rng.choice(["", "x" * 65, "not-alnum"]), seq=1),
            ),
            INVALID,
        ),
        ("d", "Step", lambda: pb.StepRequest(request_id=rid(), scheduler_id="s",
                                             session=pb.ClientSession(session_id="ab", seq=0)), INVALID),
        ("d", "Route", lambda: pb.RouteRequest(), INVALID),
        ("d", "Route", lambda: pb.RouteRequest(token_ids=[1, 2, 3], num_token_ids=[1, 1]), INVALID),
        (
            "d",
            "Route",
            lambda: pb.RouteRequest(
                token_ids=[1, 2], num_token_ids=[1, 1], salt_index=[0, rng.choice([1, -2])], salts=["a"]
            ),
            INVALID,
        ),
        (
            "d",
            "SchedulerHeartbeat",
            lambda: pb.SchedulerHeartbeatRequest(scheduler_id=rng.choice(["", "x" * 129, "\u00e9t\u00e9", "tab\tid"])),
            INVALID,
        ),
        (
            "d",
            "SchedulerHeartbeat",
            lambda: pb.SchedulerHeartbeatRequest(
                scheduler_id="fz", **rng.choice([
                    {"address": rng.choice(["x" * 300, "bad\naddress"])},
                    {"pin_pool_ids": [g() or "x" * 300]},
                    {"released_pool_ids": ["n1", "n1"]},
                ]),
            ),
            INVALID,
        ),
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
    # every unary RPC that takes input (Status, ListNodes, ListSchedulers and Fsck take none; the
    # SubscribeKvEvents stream has its own malformed-input checks: test_kv_events_stream.py)
    all_methods = {m.name for svc in pb.DESCRIPTOR.services_by_name.values() for m in svc.methods
                   if not m.server_streaming}
    assert {m for _, m in methods} == all_methods - {"Status", "ListNodes", "Fsck", "ListSchedulers"}
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
            if method == "Step":
                num_items = (len(request.alloc_seq_ids) + len(request.written_seq_ids)
                             + len(request.fork_parent_ids) + len(request.append_seq_ids))
                assert len(resp.errors) == num_items and not resp.steps, f"{request} -> {resp}"
    assert await _observable(harness) == before
    assert await harness.fsck() == []


async def test_garbage_bytes_to_every_method(harness: Harness) -> None:
    rng = random.Random(7)
    await harness.register("n1", num_blocks=16)
    before = await _observable(harness)
    methods = [f"/pagedkv.v1.BlockManager/{m.name}" for m in pb.DESCRIPTOR.services_by_name["BlockManager"].methods
               if not m.server_streaming]   # a stream answers a stream: test_kv_events_stream.py
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
