"""Asyncio client: the same calls, errors, retry replay and step helper as the sync one."""

from __future__ import annotations

import pytest

from block_manager.client import (
    Admission,
    AsyncBlockManagerClient,
    DeadlineExceededError,
    FailedPreconditionError,
    ItemFailure,
    NotFoundError,
    OutOfBlocksError,
    RetryPolicy,
    UnavailableError,
)
from tests.block_manager.client.step_workload import check_against_tables, expected_server_steps, forwarded, record

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


async def test_async_operations_and_errors(bm):
    async with AsyncBlockManagerClient(bm.address, retry=FAST_RETRY) as c:
        reg = await c.register_node("n1", 16, block_size=4)
        assert (await c.heartbeat("n1", reg.epoch)).lease_ttl_s > 0
        step = c.step()
        step.allocate("a", "n1", [1, 2, 3, 4, 5])
        res = forwarded(c, await step.commit())
        assert res.allocations["a"] == Admission("a", "n1", 0, 5)
        step = c.step()
        step.append("a", [6, 7])
        res = forwarded(c, await step.commit())
        assert res.appends["a"].context_len == 7 and res.appends["a"].deferred
        step = c.step()
        step.fork("a", ["b"])
        res = forwarded(c, await step.commit())
        assert res.forks["a"] == ("b",)
        step = c.step()
        step.append("b", num_new_tokens=1)
        res = forwarded(c, await step.commit())
        assert res.steps["n1"].copy_ops[0].kind == "cow"
        upd = await c.get_tables("n1", reg.epoch, ["b"])
        assert list(upd.tables[0].block_table) == c.tracker.get("b").block_table
        assert upd.last_step_id == res.steps["n1"].step_id
        assert (await c.route([1, 2, 3, 4]))[0].pool_id == "n1"
        step = c.step()
        step.allocate("x", "n1", num_tokens=999)
        big = (await step.commit()).allocations["x"]
        assert isinstance(big, ItemFailure) and isinstance(big.error, OutOfBlocksError)
        assert await c.free(["a", "b"]) == 2
        with pytest.raises(FailedPreconditionError):
            await c.free(["a"])
        with pytest.raises(NotFoundError):
            await c.free(["never"])
    assert bm.fsck() == []


async def test_async_retry_replays_recorded_result(bm):
    proxy = bm.start_proxy()
    async with AsyncBlockManagerClient(f"127.0.0.1:{proxy.port}", retry=FAST_RETRY) as c:
        await c.register_node("n1", 8, block_size=4)
        step = c.step()
        step.allocate("s", "n1", num_tokens=2)
        forwarded(c, await step.commit())
        proxy.fail_after_forward("Step")
        step = c.step()
        step.fork("s", ["t"])
        res = await step.commit()  # acted once; the retry gets the recorded result
        assert res.forks["s"] == ("t",) and c.stats.retries == 1
        proxy.fail_after_forward("Step")
        assert await c.free(["s", "t"]) == 2
        assert c.stats.retries == 2
        proxy.fail_after_forward("Step", times=FAST_RETRY.max_attempts)   # every answer lost
        step = c.step()
        step.allocate("u", "n1", num_tokens=3)
        with pytest.raises(UnavailableError):
            await step.commit()
        again = await step.resend()    # same request id: the recorded answer, applied once
        assert isinstance(again.allocations["u"], Admission)
        assert bm.state.core.metrics("n1").num_used_blocks == 1
        forwarded(c, again)
        assert await c.free(["u"]) == 1
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
        forwarded(c, await step.commit())
        slots = {sid: c.tracker.get(sid).slot_mapping(0, 3) for sid in ("a", "b")}
        before = c.stats.rpcs
        for k in range(12):
            step = c.step()
            step.append("a", [k])
            step.append("b", [k])
            record(c, slots, forwarded(c, await step.commit()).appends)
        assert c.stats.rpcs - before == expected_server_steps(3, 12, 8)
        tables = {t.seq_id: t.block_table for t in (await c.get_tables("n1", reg.epoch, ["a", "b"])).tables}
        check_against_tables(slots, tables, 8)
