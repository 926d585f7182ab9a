"""Sync client against an in-process block manager: registration, the scheduler step (one Step
RPC), the step contract (PoolSteps to forward, reports with the next step), scheduler leases,
typed errors, request-id reuse on retry (through a proxy that drops the answer after the server
acted), deadlines."""

from __future__ import annotations

import grpc
import pytest

from block_manager.client import (
    NO_RETRY,
    AdminClient,
    Admission,
    AlreadyExistsError,
    BlockManagerClient,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ItemFailure,
    NotFoundError,
    OutOfBlocksError,
    RetryPolicy,
    SeqSlots,
    UnavailableError,
)
from block_manager.core.types import PoolId, SeqId

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


@pytest.fixture
def client(bm):
    with BlockManagerClient(bm.address, timeout_s=5.0, retry=FAST_RETRY, seed=0, scheduler_id="sched-a") as c:
        yield c


def forward_all(c: BlockManagerClient, result, ok: bool = True) -> None:
    """What the scheduler does between steps: run each pool's Forward (here: nothing to run)
    and report it."""
    for pool_step in result.steps.values():
        c.report(pool_step, ok=ok)


def test_register_heartbeat_and_route(client):
    reg = client.register_node(
        "n1", 32, block_size=4, geometry={"num_layers": 2, "dtype": "float16"}, address="127.0.0.1:9"
    )
    assert (reg.pool_id, reg.epoch, reg.block_size, reg.num_blocks) == ("n1", 1, 4, 32)
    assert reg.lease_ttl_s == pytest.approx(30.0)
    hb = client.heartbeat("n1", reg.epoch)
    assert hb.draining is False
    step = client.step()
    step.allocate("s1", "n1", list(range(9)))
    forward_all(client, step.commit())
    client.free(["s1"])  # full blocks of s1 stay cached
    routes = client.route(list(range(9)))
    assert routes[0].pool_id == "n1" and routes[0].num_cached_tokens == 8 and routes[0].address == "127.0.0.1:9"
    many = client.route_many([(list(range(9)), None), (list(range(9)), "other-tenant"), ([5, 6], None)])
    assert [r[0].num_cached_tokens for r in many] == [8, 0, 0]


def test_one_step_rpc_carries_allocations_forks_appends_and_frees(client):
    client.register_node("n1", 32, block_size=4)
    step = client.step()
    step.allocate("a", "n1", [1, 2, 3, 4, 5])
    step.allocate("b", "n1", num_tokens=3)
    first = step.commit()
    assert first.num_rpcs == 1 and client.stats.per_method["Step"] == 1
    a, b = first.allocations["a"], first.allocations["b"]
    assert a == Admission(SeqId("a"), PoolId("n1"), 0, 5) and b.num_tokens == 3
    pool_step = first.steps[PoolId("n1")]
    assert pool_step.step_id == 1 and {d.seq_id for d in pool_step.deltas} == {"a", "b"}
    assert all(d.base_version == 0 for d in pool_step.deltas)  # new tables: the whole table
    forward_all(client, first)
    step = client.step()
    step.append("a", [6, 7, 8])
    step.append("b", num_new_tokens=1)
    step.fork("b", ["b1", "b2"])
    second = step.commit()
    assert second.settled[PoolId("n1")].settled_step == 1  # the report rode along
    assert second.appends["a"] == SeqSlots(SeqId("a"), 3, 8)
    assert second.appends["b"] == SeqSlots(SeqId("b"), 1, 4)
    assert second.forks["b"] == ("b1", "b2")
    # the client mirrors the tables from the deltas: slots for the workers, no server round trip
    a_table = client.tracker.get("a").block_table
    assert client.tracker.get("a").slot_mapping(5, 8) == [a_table[1] * 4 + i for i in (1, 2, 3)]
    forward_all(client, second)
    assert client.free(["a", "b", "b1", "b2"]) == 4
    assert client.stats.retries == 0


def test_copy_on_write_waits_for_the_parents_forward(client):
    client.register_node("n1", 16, block_size=4)
    step = client.step()
    step.allocate("p", "n1", num_tokens=2)
    first = step.commit()
    step = client.step()
    step.fork("p", ["c"])
    step.append("c", num_new_tokens=1)
    early = step.commit()
    # p's K/V is written by the Forward of step 1, not reported yet: copying it would copy garbage
    assert isinstance(early.appends["c"], ItemFailure) and early.appends["c"].error.reason == "PendingWrite"
    forward_all(client, first)
    step = client.step()
    step.append("c", num_new_tokens=1)
    third = step.commit()
    (cow,) = third.steps[PoolId("n1")].copy_ops
    assert cow.kind == "cow" and client.tracker.get("c").block_table == [cow.dst]
    (delta,) = third.steps[PoolId("n1")].deltas
    # c's table first reaches the node in this step (the fork alone wrote nothing): whole table
    assert (delta.seq_id, delta.base_version, delta.appended) == ("c", 0, (cow.dst,))


def test_defrag_rides_in_a_step_and_commits_when_reported(client, bm):
    client.register_node("n1", 16, block_size=2)
    step = client.step()
    for i in range(4):
        step.allocate(f"s{i}", "n1", num_tokens=2)
    forward_all(client, step.commit())
    client.free(["s0", "s1"])  # holes at the bottom; s2, s3 full blocks above them
    with AdminClient(bm.address) as admin:
        (plan,) = admin.trigger_defrag("n1", "compaction")["plans"]
    step = client.step()
    step.append("s2", num_new_tokens=1)
    carrying = step.commit()
    moves = [op for op in carrying.steps[PoolId("n1")].copy_ops if op.kind == "defrag"]
    assert [(m.src, m.dst) for m in moves] == [(m["src"], m["dst"]) for m in plan["moves"]]
    forward_all(client, carrying)
    after = client.step()
    after.append("s3", num_new_tokens=1)
    res = after.commit()
    assert res.settled[PoolId("n1")].committed_plan_ids == (int(plan["plan_id"]),)
    # the rewritten tables reach the node with the next step
    assert {d.seq_id for d in res.steps[PoolId("n1")].deltas} >= {"s2", "s3"}
    assert bm.fsck() == []


def test_a_failed_forward_drops_what_its_step_wrote(client, bm):
    client.register_node("n1", 16, block_size=4)
    step = client.step()
    step.allocate("keep", "n1", num_tokens=3)
    forward_all(client, step.commit())
    step = client.step()
    step.allocate("lost", "n1", num_tokens=6)
    failed = step.commit()
    forward_all(client, failed, ok=False)
    res = client.flush_reports()
    assert res is not None and res.dropped == {"lost"}
    assert [v.seq_id for v in bm.state.core.sequences()] == ["keep"]
    assert client.tracker.get("lost") is None


def test_error_mapping(client, bm):
    reg = client.register_node("n1", 4, block_size=4)
    step = client.step()
    step.allocate("big", "n1", num_tokens=100)
    fail = step.commit().allocations["big"]
    assert isinstance(fail, ItemFailure) and isinstance(fail.error, OutOfBlocksError)
    assert fail.error.reason == "OutOfBlocks" and fail.seq_id == "big"
    step = client.step()
    step.allocate("s", "n1", num_tokens=1)
    forward_all(client, step.commit())
    step = client.step()
    step.fork("s", ["s"])
    assert isinstance(step.commit().forks["s"].error, AlreadyExistsError)
    with pytest.raises(NotFoundError):
        client.free(["nope"])
    client.free(["s"])
    with pytest.raises(FailedPreconditionError) as exc:
        client.free(["s"])
    assert "already freed" in exc.value.message
    step = client.step()
    step.append("x", [1])
    step.append("x2", [1])
    with pytest.raises(InvalidArgumentError):
        step.commit(request_id="r" * 200)
    client.register_node("n1", 4, block_size=4)  # new epoch fences epoch 1
    with pytest.raises(FailedPreconditionError):
        client.heartbeat("n1", reg.epoch)
    step = client.step(pool_epochs={"n1": reg.epoch})
    step.allocate("t", "n1", num_tokens=1)
    with pytest.raises(FailedPreconditionError):
        step.commit()
    assert client.stats.retries == 0
    assert bm.fsck() == []


def test_one_scheduler_per_pool(client, bm):
    client.register_node("n1", 16, block_size=4)
    step = client.step()
    step.allocate("a", "n1", num_tokens=3)
    forward_all(client, step.commit())
    with BlockManagerClient(bm.address, retry=NO_RETRY, scheduler_id="sched-b") as other:
        step = other.step()
        step.allocate("b", "n1", num_tokens=3)
        with pytest.raises(FailedPreconditionError) as exc:
            step.commit()
        assert "sched-a" in exc.value.message
        client.free(["a"])
        client.release()  # sched-a hands the pool back
        step = other.step()
        step.allocate("b", "n1", num_tokens=3)
        assert isinstance(step.commit().allocations["b"], Admission)
    assert bm.fsck() == []


def test_retry_reuses_request_id_after_server_acted(bm):
    proxy = bm.start_proxy()
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY, seed=1) as c:
        c.register_node("n1", 8, block_size=4)
        proxy.fail_after_forward("Step")
        step = c.step()
        step.allocate("s", "n1", num_tokens=5)
        first = step.commit()  # first answer lost, the retry replays it
        assert c.stats.retries == 1 and c.stats.per_method["Step"] == 2
        assert isinstance(first.allocations["s"], Admission)
        assert bm.state.core.metrics(PoolId("n1")).num_used_blocks == 2  # allocated once
        forward_all(c, first)
        proxy.fail_after_forward("Step")
        step = c.step()
        step.append("s", num_new_tokens=4)
        assert step.commit().appends["s"].context_len == 9  # not 13: acted once
        proxy.fail_after_forward("Step", times=2)
        assert c.free(["s"]) == 1  # the replay, not FAILED_PRECONDITION (double free)
        assert c.stats.retries == 4
    assert proxy.calls.count("Step") == 7
    assert bm.fsck() == []


def test_resend_after_the_retries_gave_up_applies_the_step_once(bm):
    """A Step whose every attempt lost its answer (the server acted on the first) raises
    UNAVAILABLE; `resend` repeats it under the same request id and gets the recorded answer.
    A sequence the step answered locally stays tracked with its deferred tokens."""
    proxy = bm.start_proxy()
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY, seed=2) as c:
        c.register_node("n1", 16, block_size=4)
        c.tracker.set_block_size("n1", 4)
        step = c.step()
        step.allocate("local", "n1", [1, 2, 3, 4, 5])      # 5 of 8 slots: the next token is in-block
        forward_all(c, step.commit())
        proxy.fail_after_forward("Step", times=FAST_RETRY.max_attempts)
        step = c.step()
        step.allocate("s", "n1", num_tokens=5)
        step.append("local", [6])                            # answered here, not in the request
        with pytest.raises(UnavailableError):
            step.commit()
        assert c.tracker.get("local").num_tokens == 6 and c.tracker.get("s") is None
        again = step.resend()
        assert isinstance(again.allocations["s"], Admission) and again.appends["local"].deferred
        assert bm.state.core.metrics(PoolId("n1")).num_used_blocks == 4   # "s" allocated once
        forward_all(c, again)
        step = c.step()
        step.append("local", [7, 8])                          # fills the block: the server hears 3 tokens
        assert step.commit().appends["local"].context_len == 8
        with pytest.raises(InvalidArgumentError):
            step.resend()                                     # answered: nothing to resend
    assert bm.fsck() == []


def test_retries_are_bounded_and_only_for_transient_codes(bm):
    proxy = bm.start_proxy()
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY) as c:
        c.register_node("n1", 8)
        step = c.step()
        step.allocate("s", "n1", num_tokens=1)
        forward_all(c, step.commit())
        proxy.fail_after_forward("Step", times=5)
        with pytest.raises(Exception) as exc:
            c.free(["s"])
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert c.stats.per_method["Step"] == 1 + FAST_RETRY.max_attempts
        with pytest.raises(NotFoundError):
            c.free(["unknown"])
        assert c.stats.per_method["Step"] == 2 + FAST_RETRY.max_attempts  # NOT_FOUND: no retry


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
