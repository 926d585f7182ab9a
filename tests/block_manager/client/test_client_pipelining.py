"""`AsyncBlockManagerClient(pipeline_steps=True)`: commits overlap, each stamped after the one
before it. The server applies them in commit order even when the later one reaches it first; a
step whose predecessor the server refused is refused too; one whose predecessor's answer was
lost is applied by the server but raised by the client (its request kept), and resending both
in order gets both answers."""

from __future__ import annotations

import asyncio

from block_manager.client import AsyncBlockManagerClient, FailedPreconditionError, RetryPolicy, UnavailableError
from block_manager.client.session import ClientSessionState
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.client.step_workload import forwarded

ONCE = RetryPolicy(max_attempts=1)


async def _client(target: str) -> AsyncBlockManagerClient:
    c = AsyncBlockManagerClient(target, retry=ONCE, pipeline_steps=True)
    await c.register_node("n1", 64, block_size=4)
    return c


def _proxy(bm):  # type: ignore[no-untyped-def]
    return bm.start_proxy()


async def test_a_later_commit_that_overtakes_is_applied_after_the_earlier_one(bm) -> None:
    proxy = _proxy(bm)
    async with await _client(f"127.0.0.1:{proxy.port}") as c:
        first, second = c.step(), c.step()
        first.allocate("a", "n1", [1, 2, 3, 4, 5])
        second.allocate("b", "n1", [6, 7, 8])
        proxy.delay("Step", 0.3)   # the first reaches the server last
        r1, r2 = await asyncio.gather(first.commit(), second.commit())
        assert not r1.failures and not r2.failures
        assert r1.steps["n1"].step_id < r2.steps["n1"].step_id   # applied in commit order
        stamps = c.session
        assert not stamps.in_flight and not stamps.unsettled
        forwarded(c, r1)
        forwarded(c, r2)
        step = c.step()
        step.append("a", [9])
        step.append("b", [9])
        assert not (await step.commit()).failures


async def test_a_refused_predecessor_refuses_its_successor(bm) -> None:
    async with await _client(bm.address) as c:
        bad, good = c.step(pool_epochs={"n1": 99}), c.step()   # a stale epoch refuses the whole step
        bad.allocate("a", "n1", [1, 2])
        good.allocate("b", "n1", [3, 4])
        results = await asyncio.gather(bad.commit(), good.commit(), return_exceptions=True)
        assert all(isinstance(r, FailedPreconditionError) for r in results), results
        assert "predecessor" in str(results[1])
        assert not bm.state.core.has_sequence("b")


async def test_a_lost_answer_fails_the_successor_until_both_are_resent_in_order(bm) -> None:
    proxy = _proxy(bm)
    async with await _client(f"127.0.0.1:{proxy.port}") as c:
        first, second = c.step(), c.step()
        first.allocate("a", "n1", [1, 2, 3])
        second.allocate("b", "n1", [4, 5, 6])
        proxy.fail_after_forward("Step")   # the first is applied, its answer lost
        results = await asyncio.gather(first.commit(), second.commit(), return_exceptions=True)
        assert isinstance(results[0], UnavailableError)
        assert isinstance(results[1], FailedPreconditionError) and results[1].reason == "PredecessorFailed"
        assert bm.state.core.has_sequence("b")   # the server applied it (its predecessor was)
        r1 = await first.resend()
        r2 = await second.resend()
        assert r1.allocations["a"].num_tokens == 3 and r2.allocations["b"].num_tokens == 3
        assert r1.steps["n1"].step_id < r2.steps["n1"].step_id


def test_the_flag_stamps_after_only_on_numbers_in_flight() -> None:
    s = ClientSessionState(session_id="s1", pipelined=True)
    a, b, c = pb.StepRequest(), pb.StepRequest(), pb.StepRequest()
    s.stamp(a)
    s.stamp(b)
    assert (a.session.after, b.session.after) == (0, a.session.seq)
    s.returned(a)
    s.returned(b)   # b's outcome unknown (no settle): not waited on by what comes next
    s.stamp(c)
    assert c.session.after == 0 and c.session.acked == a.session.seq


def test_without_the_flag_nothing_is_stamped_after() -> None:
    s = ClientSessionState(session_id="s1")
    reqs = [pb.StepRequest() for _ in range(3)]
    for r in reqs:
        s.stamp(r)
    assert [r.session.after for r in reqs] == [0, 0, 0]
