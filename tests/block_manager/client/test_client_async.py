"""Asyncio client: the same calls, errors, retry replay and step helper as the sync one."""

from __future__ import annotations

import pytest

from block_manager.client import (
    AllocateSpec,
    AsyncBlockManagerClient,
    DeadlineExceededError,
    FailedPreconditionError,
    ItemFailure,
    NotFoundError,
    OutOfBlocksError,
    RetryPolicy,
)
from block_manager.core.types import AppendRequest, AppendResult, PoolId, SeqId
from tests.block_manager.client.step_workload import check_against_tables, expected_server_steps, record

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


async def test_async_operations_and_errors(bm):
    async with AsyncBlockManagerClient(bm.address, retry=FAST_RETRY) as c:
        reg = await c.register_node("n1", 16, block_size=4)
        assert (await c.heartbeat("n1", reg.epoch)).lease_ttl_s > 0
        a = await c.allocate_one("a", "n1", [1, 2, 3, 4, 5])
        assert len(a.block_table) == 2 and a.num_cached_tokens == 0
        (r,) = await c.append_slots([AppendRequest(SeqId("a"), 2, (6, 7))])
        assert isinstance(r, AppendResult) and r.num_tokens == 7
        (child,) = await c.fork("a", ["b"])
        assert child.block_table == a.block_table
        (rb,) = await c.append_slots([AppendRequest(SeqId("b"), 1)])
        assert isinstance(rb, AppendResult) and rb.copy_ops[0].kind == "cow"
        upd = await c.get_tables("n1", reg.epoch, ["b"])
        assert upd.tables[0].version == rb.version and upd.copy_ops[0].op_id == rb.copy_ops[0].op_id
        assert await c.ack_copy_ops("n1", reg.epoch, rb.copy_ops[0].op_id) == []
        assert (await c.route([1, 2, 3, 4]))[0].pool_id == "n1"
        (big,) = await c.allocate([AllocateSpec(SeqId("x"), PoolId("n1"), None, 999)])
        assert isinstance(big, ItemFailure) and isinstance(big.error, OutOfBlocksError)
        assert await c.free(["a", "b"]) == 2
        with pytest.raises(FailedPreconditionError):
            await c.free(["a"])
        with pytest.raises(NotFoundError):
            await c.plan_defrag("nope")
    assert bm.fsck() == []


async def test_async_retry_replays_recorded_result(bm):
    proxy = bm.start_proxy()
    async with AsyncBlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY) as c:
        await c.register_node("n1", 8, block_size=4)
        await c.allocate_one("s", "n1", num_tokens=2)
        proxy.fail_after_forward("Fork")
        (child,) = await c.fork("s", ["t"])  # acted once; the retry gets the recorded children
        assert child.seq_id == "t" and c.stats.retries == 1
        proxy.fail_after_forward("Free")
        assert await c.free(["s", "t"]) == 2
        assert c.stats.retries == 2
        proxy.delay("Route", 1.0, times=3)
    async with AsyncBlockManagerClient(
        f"127.0.0.1:{proxy.port}", timeout_s=0.2, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    ) as c:
        with pytest.raises(DeadlineExceededError):
            await c.route([1])
        assert c.stats.per_method["Route"] == 2
    assert bm.fsck() == []


async def test_async_step_decode(bm):
    async with AsyncBlockManagerClient(bm.address) as c:
        reg = await c.register_node("n1", 64, block_size=8)
        step = c.step()
        step.allocate("a", "n1", [1, 2, 3])
        step.allocate("b", "n1", [4, 5, 6])
        res = await step.commit()
        slots = {sid: list(res.allocations[sid].slot_mapping) for sid in ("a", "b")}
        before = c.stats.rpcs
        for k in range(12):
            step = c.step()
            step.append("a", [k])
            step.append("b", [k])
            record(slots, (await step.commit()).appends)
        assert c.stats.rpcs - before == expected_server_steps(3, 12, 8)
        tables = {t.seq_id: t.block_table for t in (await c.get_tables("n1", reg.epoch, ["a", "b"])).tables}
        check_against_tables(slots, tables, 8)
