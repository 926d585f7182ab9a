"""Sync client against an in-process block manager: every data-plane call, typed errors,
request-id reuse on retry (through a proxy that drops the answer after the server acted),
deadlines."""

from __future__ import annotations

import grpc
import pytest

from block_manager.client import (
    NO_RETRY,
    AllocateSpec,
    AlreadyExistsError,
    BlockManagerClient,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ItemFailure,
    NotFoundError,
    OutOfBlocksError,
    RetryPolicy,
)
from block_manager.core.types import AllocateResult, AppendRequest, AppendResult, PoolId, SeqId

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


@pytest.fixture
def client(bm):
    with BlockManagerClient(bm.address, timeout_s=5.0, retry=FAST_RETRY, seed=0) as c:
        yield c


def spec(seq: str, pool: str = "n1", tokens: list[int] | None = None, num_tokens: int | None = None) -> AllocateSpec:
    return AllocateSpec(SeqId(seq), PoolId(pool), tuple(tokens) if tokens is not None else None, num_tokens)


def test_register_heartbeat_and_route(client):
    reg = client.register_node(
        "n1", 32, block_size=4, geometry={"num_layers": 2, "dtype": "float16"}, address="127.0.0.1:9"
    )
    assert (reg.pool_id, reg.epoch, reg.block_size, reg.num_blocks) == ("n1", 1, 4, 32)
    assert reg.lease_ttl_s == pytest.approx(30.0)
    hb = client.heartbeat("n1", reg.epoch)
    assert hb.draining is False and hb.last_pending_op_id is None
    client.allocate_one("s1", "n1", list(range(9)))
    client.free(["s1"])  # full blocks of s1 stay cached
    routes = client.route(list(range(9)))
    assert routes[0].pool_id == "n1" and routes[0].num_cached_tokens == 8 and routes[0].address == "127.0.0.1:9"


def test_allocate_append_fork_free_roundtrip(client):
    client.register_node("n1", 32, block_size=4)
    outs = client.allocate([spec("a", tokens=[1, 2, 3, 4, 5]), spec("b", num_tokens=3)])
    a, b = outs
    assert isinstance(a, AllocateResult) and a.block_table and len(a.slot_mapping) == 5 and a.version == 1
    assert isinstance(b, AllocateResult) and len(b.slot_mapping) == 3
    appended = client.append_slots([AppendRequest(SeqId("a"), 3, (6, 7, 8)), AppendRequest(SeqId("b"), 1)])
    ra, rb = appended
    assert isinstance(ra, AppendResult) and ra.num_tokens == 8 and len(ra.slot_mapping) == 3
    assert ra.slot_mapping[0] == a.block_table[1] * 4 + 1
    assert isinstance(rb, AppendResult) and rb.num_tokens == 4 and rb.new_block_ids == ()
    children = client.fork("b", ["b1", "b2"])
    assert [c.seq_id for c in children] == ["b1", "b2"]
    assert all(c.block_table == b.block_table and c.num_tokens == 4 for c in children)
    assert client.free(["a", "b", "b1", "b2"]) == 4
    assert client.stats.per_method["Allocate"] == 1 and client.stats.retries == 0


def test_cow_copy_ops_tables_and_ack(client):
    reg = client.register_node("n1", 16, block_size=4)
    client.allocate_one("p", "n1", num_tokens=2)
    client.fork("p", ["c"])
    (res,) = client.append_slots([AppendRequest(SeqId("c"), 1)])
    assert isinstance(res, AppendResult) and len(res.copy_ops) == 1 and res.copy_ops[0].kind == "cow"
    op = res.copy_ops[0]
    upd = client.get_tables("n1", reg.epoch, ["p", "c"], {"p": 1})
    assert [t.seq_id for t in upd.tables] == ["c"] and upd.tables[0].block_table == (op.dst,)
    assert [o.op_id for o in upd.copy_ops] == [op.op_id]
    assert client.heartbeat("n1", reg.epoch).last_pending_op_id == op.op_id
    assert client.ack_copy_ops("n1", reg.epoch, op.op_id) == []
    assert client.get_tables("n1", reg.epoch, [], after_op_id=0).copy_ops == ()


def test_defrag_plan_commit_and_abort(client):
    reg = client.register_node("n1", 16, block_size=2)
    for i in range(4):
        client.allocate_one(f"s{i}", "n1", num_tokens=2)
    client.free(["s0", "s1"])  # holes at the bottom; s2, s3 full blocks above them
    plan = client.plan_defrag("n1", "compaction")
    assert plan is not None and plan.kind == "compaction" and plan.moves
    client.abort_defrag(plan.plan_id)
    plan = client.plan_defrag("n1")
    assert plan is not None
    with pytest.raises(FailedPreconditionError):
        client.commit_defrag(plan.plan_id)  # moves not acknowledged yet
    assert client.ack_copy_ops("n1", reg.epoch, plan.moves[-1].op_id) == [plan.plan_id]
    with pytest.raises(NotFoundError):
        client.commit_defrag(plan.plan_id)  # committed by the ack
    assert client.plan_defrag("n1") is None


def test_error_mapping(client, bm):
    reg = client.register_node("n1", 4, block_size=4)
    (fail,) = client.allocate([spec("big", num_tokens=100)])
    assert isinstance(fail, ItemFailure) and isinstance(fail.error, OutOfBlocksError)
    assert fail.error.reason == "OutOfBlocks" and fail.seq_id == "big"
    with pytest.raises(OutOfBlocksError):
        client.allocate_one("big", "n1", num_tokens=100)
    client.allocate_one("s", "n1", num_tokens=1)
    with pytest.raises(AlreadyExistsError):
        client.fork("s", ["s"])
    with pytest.raises(NotFoundError):
        client.free(["nope"])
    client.free(["s"])
    with pytest.raises(FailedPreconditionError) as exc:
        client.free(["s"])
    assert "already freed" in exc.value.message
    with pytest.raises(InvalidArgumentError):
        client.allocate([])
    with pytest.raises(InvalidArgumentError):
        client.free(["x"], request_id="")
    client.register_node("n1", 4, block_size=4)  # new epoch fences epoch 1
    with pytest.raises(FailedPreconditionError):
        client.heartbeat("n1", reg.epoch)
    with pytest.raises(FailedPreconditionError):
        client.allocate([spec("t", num_tokens=1)], pool_epochs={"n1": reg.epoch})
    assert client.stats.retries == 0 and client.stats.errors == 7  # per-item failures are answers
    assert bm.fsck() == []


def test_retry_reuses_request_id_after_server_acted(bm):
    proxy = bm.start_proxy()
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY, seed=1) as c:
        c.register_node("n1", 8, block_size=4)
        proxy.fail_after_forward("Allocate")
        a = c.allocate_one("s", "n1", num_tokens=5)  # first answer lost, retry replays it
        assert c.stats.retries == 1 and c.stats.per_method["Allocate"] == 2
        assert bm.state.core.get_sequence(SeqId("s")).block_table == a.block_table
        assert bm.state.core.metrics(PoolId("n1")).num_used_blocks == 2  # allocated once
        proxy.fail_after_forward("AppendSlots")
        (r,) = c.append_slots([AppendRequest(SeqId("s"), 4)])
        assert isinstance(r, AppendResult) and r.num_tokens == 9  # not 13: acted once
        proxy.fail_after_forward("Free", times=2)
        assert c.free(["s"]) == 1  # the replay, not FAILED_PRECONDITION (double free)
        assert c.stats.retries == 4
    assert proxy.calls.count("Free") == 3
    assert bm.fsck() == []


def test_retries_are_bounded_and_only_for_transient_codes(bm):
    proxy = bm.start_proxy()
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY) as c:
        c.register_node("n1", 8)
        proxy.fail_after_forward("Free", times=5)
        c.allocate_one("s", "n1", num_tokens=1)
        with pytest.raises(Exception) as exc:
            c.free(["s"])
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert c.stats.per_method["Free"] == FAST_RETRY.max_attempts
        with pytest.raises(NotFoundError):
            c.free(["unknown"])
        assert c.stats.per_method["Free"] == FAST_RETRY.max_attempts + 1  # NOT_FOUND: no retry


def test_deadline(bm):
    proxy = bm.start_proxy()
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", timeout_s=0.2, retry=NO_RETRY) as c:
        c.register_node("n1", 8)
        proxy.delay("Route", 1.0)
        with pytest.raises(DeadlineExceededError):
            c.route([1, 2, 3])
        assert c.route([1, 2, 3], timeout_s=2.0)[0].pool_id == "n1"


def test_unreachable_server_is_unavailable():
    with BlockManagerClient(
        "127.0.0.1:1", timeout_s=0.5, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    ) as c:
        with pytest.raises(Exception) as exc:
            c.route([1])
        assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert c.stats.rpcs == 2 and c.stats.retries == 1
