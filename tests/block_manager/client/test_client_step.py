"""The scheduler-step helper: one Step RPC per step, deferred in-block appends (the client's
mirrored tables agree with the server's), RPCs per generated token, fork flushes, restart
re-reporting, misuse, ambiguous failures."""

from __future__ import annotations

import pytest

from block_manager.client import (
    BlockManagerClient,
    InvalidArgumentError,
    ItemFailure,
    OutOfBlocksError,
    RetryPolicy,
    SeqSlots,
    StepStateError,
    UnavailableError,
)
from block_manager.core.types import AppendRequest, SeqId
from tests.block_manager.client.server_thread import ServerThread
from tests.block_manager.client.step_workload import check_against_tables, expected_server_steps, forwarded, record

BS = 8


@pytest.fixture
def client(bm):
    with BlockManagerClient(bm.address) as c:
        yield c


def tables_of(client: BlockManagerClient, epoch: int, seq_ids: list[str]) -> dict[str, tuple[int, ...]]:
    return {t.seq_id: t.block_table for t in client.get_tables("n1", epoch, seq_ids).tables}


def admit(client: BlockManagerClient, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    step = client.step()
    for sid, tokens in prompts.items():
        step.allocate(sid, "n1", tokens)
    res = forwarded(client, step.commit())
    assert not res.failures
    return {sid: client.tracker.get(sid).slot_mapping(0, len(tokens)) for sid, tokens in prompts.items()}


def test_decode_rpcs_per_token_and_tables_match_server(client, bm):
    reg = client.register_node("n1", 64, block_size=BS)
    seqs = [f"s{i}" for i in range(4)]
    slots = admit(client, {sid: [100 * i + t for t in range(5)] for i, sid in enumerate(seqs)})
    rpcs_before = client.stats.rpcs
    num_steps = 20
    for k in range(num_steps):
        step = client.step()
        for sid in seqs:
            step.append(sid, [7000 + k])
        res = forwarded(client, step.commit())
        record(client, slots, res.appends)
        assert res.num_rpcs in (0, 1)
    decode_rpcs = client.stats.rpcs - rpcs_before
    assert decode_rpcs == expected_server_steps(5, num_steps, BS) == 6
    assert client.stats.deferred_tokens == (num_steps - 6) * len(seqs)
    check_against_tables(slots, tables_of(client, reg.epoch, seqs), BS)
    core = bm.state.core
    for sid in seqs:  # the server lags only by the deferred tokens, inside the last block
        t = client.tracker.get(sid)
        assert core.get_sequence(SeqId(sid)).num_tokens == t.num_tokens - t.num_deferred
        assert t.num_deferred < BS - 1
        assert tuple(t.block_table) == core.get_sequence(SeqId(sid)).block_table
    step = client.step()
    step.free(seqs)
    assert step.commit().num_freed == 4 and len(client.tracker) == 0
    assert bm.fsck() == []


def test_full_blocks_are_reported_for_prefix_caching(client, bm):
    client.register_node("n1", 64, block_size=BS)
    admit(client, {"a": list(range(5))})
    for t in range(5, 16):  # fills block 0 (token 7) and block 1 (token 15) through the helper
        step = client.step()
        step.append("a", [t])
        forwarded(client, step.commit())
    client.free(["a"])
    assert client.route(list(range(17)))[0].num_cached_tokens == 16


def test_fork_reports_deferred_parent_first_and_children_cow(client, bm):
    reg = client.register_node("n1", 64, block_size=BS)
    admit(client, {"p": list(range(5))})
    step = client.step()
    step.append("p", [5])
    assert step.commit().appends["p"].deferred
    assert bm.state.core.get_sequence(SeqId("p")).num_tokens == 5
    step = client.step()
    step.fork("p", ["c"])
    step.append("c", [6])
    step.append("p", [6])  # the fork shares p's tail: the server decides (copy-on-write)
    res = forwarded(client, step.commit())
    assert res.num_rpcs == 1  # the already-written report, the fork and the appends: one Step
    assert res.forks["p"] == ("c",)
    assert bm.state.core.get_sequence(SeqId("c")).num_tokens == 7
    c, p = res.appends["c"], res.appends["p"]
    assert isinstance(c, SeqSlots) and not c.deferred and c.context_len == 7
    assert isinstance(p, SeqSlots) and not p.deferred and p.context_len == 7
    cows = [op for op in res.steps["n1"].copy_ops if op.kind == "cow"]
    assert len(cows) == 1  # c copies the shared partial block; p then owns it alone
    tables = tables_of(client, reg.epoch, ["p", "c"])
    assert tables["p"][0] != tables["c"][0] or tables["p"][-1] != tables["c"][-1]
    assert tables["p"] == tuple(client.tracker.get("p").block_table)
    assert bm.fsck() == []


def test_deferred_tokens_are_re_reported_after_restart(tmp_path):
    db = f"sqlite:///{tmp_path / 'bm.db'}"
    first = ServerThread(database_url=db)
    try:
        with BlockManagerClient(first.address, scheduler_id="sched") as c:
            c.register_node("n1", 32, block_size=BS)
            slots = admit(c, {"s": list(range(3))})
            for t in (3, 4, 5):
                step = c.step()
                step.append("s", [t])
                record(c, slots, step.commit().appends)
            tracker, reports = c.tracker, c.pending_reports
            assert tracker.get("s").num_deferred == 3
    finally:
        first.stop()
    second = ServerThread(database_url=db)
    try:
        assert second.state.core.get_sequence(SeqId("s")).num_tokens == 3  # never reported
        with BlockManagerClient(second.address, scheduler_id="sched") as c:
            c.tracker = tracker
            c._reports.update(reports)
            for t in (6, 7, 8):
                step = c.step()
                step.append("s", [t])
                record(c, slots, forwarded(c, step.commit()).appends)
            assert c.stats.per_method["Step"] == 2  # fill (6 -> 7) and new block (8)
            assert c.stats.rpcs == 3                 # and the client session, opened once
            view = second.state.core.get_sequence(SeqId("s"))
            assert view.num_tokens == 9
            check_against_tables(slots, {"s": view.block_table}, BS)
        assert second.fsck() == []
    finally:
        second.stop()


def test_foreign_append_is_detected(client, bm):
    client.register_node("n1", 32, block_size=BS)
    step = client.step()
    step.allocate("s", "n1", num_tokens=2)
    forwarded(client, step.commit())
    step = client.step()
    step.append("s", num_new_tokens=1)
    assert step.commit().appends["s"].deferred
    bm.state.core.append_slots([AppendRequest(SeqId("s"), 1)])  # behind the helper's back
    step = client.step()
    step.append("s", num_new_tokens=5)  # 3 + 1 deferred + 5 crosses the block: server
    out = step.commit().appends["s"]
    assert isinstance(out, ItemFailure) and isinstance(out.error, StepStateError)
    assert client.tracker.get("s") is None  # no longer trusted; later appends go to the server


def test_untracked_pool_always_asks_server(bm):
    with BlockManagerClient(bm.address) as node, BlockManagerClient(bm.address) as sched:
        node.register_node("n1", 32, block_size=BS)  # the scheduler never learns the block size
        step = sched.step()
        step.allocate("s", "n1", num_tokens=2)
        forwarded(sched, step.commit())
        for _ in range(3):
            step = sched.step()
            step.append("s", num_new_tokens=1)
            assert forwarded(sched, step.commit()).num_rpcs == 1
        assert sched.stats.deferred_tokens == 0


def test_item_failures_and_misuse(client):
    client.register_node("n1", 4, block_size=BS)
    step = client.step()
    step.allocate("ok", "n1", num_tokens=3)
    step.allocate("big", "n1", num_tokens=1000)
    step.append("ghost", num_new_tokens=1)
    res = step.commit()
    assert res.num_rpcs == 1
    assert isinstance(res.allocations["big"], ItemFailure) and isinstance(
        res.allocations["big"].error, OutOfBlocksError
    )
    assert [f.seq_id for f in res.failures] == ["big", "ghost"]
    with pytest.raises(InvalidArgumentError):
        step.commit()
    step = client.step()
    step.append("ok", num_new_tokens=1)
    with pytest.raises(InvalidArgumentError):
        step.append("ok", num_new_tokens=1)
    with pytest.raises(InvalidArgumentError):
        step.append("x", [])
    with pytest.raises(InvalidArgumentError):
        step.append("y", [1, 2], num_new_tokens=3)
    with pytest.raises(InvalidArgumentError):
        step.allocate("z", "n1")


def test_ambiguous_failures_stop_local_answers(bm):
    """A step RPC that fails after every retry may still have acted: the helper must not
    compute slots locally from a view that might be stale."""
    proxy = bm.start_proxy()
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=retry) as c:
        c.register_node("n1", 32, block_size=BS)
        step = c.step()
        step.allocate("s", "n1", num_tokens=2)
        step.allocate("p", "n1", num_tokens=2)
        forwarded(c, step.commit())
        step = c.step()
        step.append("s", num_new_tokens=1)
        assert step.commit().appends["s"].deferred
        proxy.fail_after_forward("Step", times=2)
        step = c.step()
        step.append("s", num_new_tokens=6)  # crosses the block: server; every answer lost
        with pytest.raises(UnavailableError):
            step.commit()
        assert c.tracker.get("s") is None
        assert bm.state.core.get_sequence(SeqId("s")).num_tokens == 9  # acted exactly once
        step = c.step()
        step.append("s", num_new_tokens=1)
        res = step.commit()
        assert res.num_rpcs == 1 and res.appends["s"].context_len == 10
    assert bm.fsck() == []


def test_late_ids_ride_the_next_step_and_survive_a_restart(tmp_path):
    """Async scheduling's late ids over the wire: a token that fills a block goes to the block
    manager before its id (`num_late`); the block is hashed only when the id arrives with the
    next Step, also when the block manager restarted in between (the pending ids are in its
    journal); ids nobody awaits are refused item by item."""
    db = f"sqlite:///{tmp_path / 'bm.db'}"
    first = ServerThread(database_url=db)
    try:
        with BlockManagerClient(first.address, scheduler_id="sched") as c:
            c.register_node("n1", 32, block_size=BS)
            admit(c, {"a": list(range(7))})
            step = c.step()
            step.append("a", [-1], num_late=1)    # token 7 fills block 0; its id is not known yet
            res = forwarded(c, step.commit())
            assert not res.appends["a"].deferred and res.appends["a"].context_len == 8
            assert first.state.core.num_prefix_hashes("n1") == 0   # no hash on a placeholder
            tracker, reports = c.tracker, c.pending_reports
    finally:
        first.stop()
    second = ServerThread(database_url=db)
    try:
        core = second.state.core
        assert core.num_prefix_hashes("n1") == 0 and core.fsck() == []
        with BlockManagerClient(second.address, scheduler_id="sched") as c:
            c.tracker = tracker
            c._reports.update(reports)
            c.tracker.resolve_late("a", [7])
            step = c.step()
            step.append("a", [8])                 # starts block 1: the id of 7 goes first, same Step
            res = forwarded(c, step.commit())
            assert res.num_rpcs == 1 and not res.failures and res.appends["a"].context_len == 9
            assert core.num_prefix_hashes("n1") == 1 and c.tracker.late_ids == {}
            c.tracker.resolve_late("a", [9])      # nobody awaits it: refused, nothing else changes
            step = c.step()
            step.append("a", [9])                 # in-block: answered here ...
            step.allocate("b", "n1", [50, 51])    # ... and a Step that needs the trip
            res = forwarded(c, step.commit())
            assert list(res.late_failures) == ["a"] and res.late_failures["a"].error.reason == "InvalidRequest"
            assert res.appends["a"].deferred and c.tracker.get("a").num_tokens == 10
            assert not isinstance(res.allocations["b"], ItemFailure) and c.tracker.late_ids == {}
            c.free(["a", "b"])
            assert c.route(list(range(9)))[0].num_cached_tokens == 8
        assert second.fsck() == []
    finally:
        second.stop()


def test_a_late_id_answered_in_place_joins_the_deferred_ids(client, bm):
    """In-block, an append with a late id is answered here: `resolve_late` puts the id among
    the deferred ids (the server later hashes the real one); before that the sequence may not
    go to the server."""
    client.register_node("n1", 64, block_size=BS)
    admit(client, {"a": list(range(6))})
    step = client.step()
    step.append("a", [-1], num_late=1)       # token 6: in block 0, answered here
    assert step.commit().appends["a"].deferred
    assert client.tracker.get("a").deferred_token_ids == [-1]
    step = client.step()
    step.append("a", [7])                    # fills block 0: the server would need token 6's id
    with pytest.raises(InvalidArgumentError, match="still to come"):
        step.commit()
    client.tracker.resolve_late("a", [6])
    assert client.tracker.get("a").deferred_token_ids == [6] and client.tracker.late_ids == {}
    step = client.step()
    step.append("a", [7])
    res = forwarded(client, step.commit())
    assert res.appends["a"].context_len == 8 and not res.failures
    client.free(["a"])
    assert client.route(list(range(9)))[0].num_cached_tokens == 8
    assert bm.fsck() == []


def test_a_step_cancelled_by_a_stopping_server_is_retried_under_its_request_id(bm):
    """A server stopping mid-call cancels it (CANCELLED): the outcome is unknown, as with
    UNAVAILABLE, so the client retries the same request id and the step applies once; after
    the retries, the error is an `UnavailableError` (a `CancelledError`) a scheduler resends."""
    import grpc

    from block_manager.client import CancelledError

    proxy = bm.start_proxy()
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01)
    with BlockManagerClient(f"127.0.0.1:{proxy.port}", retry=retry) as c:
        c.register_node("n1", 32, block_size=BS)
        proxy.fail_after_forward("Step", times=2, code=grpc.StatusCode.CANCELLED)
        step = c.step()
        step.allocate("s", "n1", num_tokens=3)
        res = forwarded(c, step.commit())                       # third attempt: the recorded answer
        assert res.allocations["s"].num_tokens == 3 and c.stats.retries == 2
        proxy.fail_after_forward("Step", times=3, code=grpc.StatusCode.CANCELLED)
        step = c.step()
        step.allocate("t", "n1", num_tokens=3)
        with pytest.raises(UnavailableError) as info:
            step.commit()
        assert isinstance(info.value, CancelledError)
        assert step.resend().allocations["t"].num_tokens == 3
        assert bm.state.core.metrics("n1").num_used_blocks == 2  # each allocated once
    assert bm.fsck() == []


def test_an_admission_in_the_step_that_resets_its_pool_is_mirrored(bm):
    """A pool that changed hands comes back with a reset step: the new driver's mirror drops what
    it held there before, but the admissions of that very step stay mirrored (and agree with the
    server's tables), so its appends keep being answered locally."""
    with BlockManagerClient(bm.address, scheduler_id="first") as first:
        first.register_node("n1", 64, block_size=BS)
        admit(first, {"old": list(range(5))})
        first.release()                      # hands the pool back: "old" is dropped with it
    with BlockManagerClient(bm.address, scheduler_id="second") as second:
        second.tracker.set_block_size("n1", BS)
        step = second.step()
        step.allocate("new", "n1", list(range(100, 111)))
        res = step.commit()
        assert res.steps["n1"].reset and not res.failures
        mirror = second.tracker.get("new")
        assert mirror is not None and mirror.num_tokens == 11
        assert tables_of(second, res.steps["n1"].epoch, ["new"])["new"] == tuple(mirror.block_table)
        second.report(res.steps["n1"], True)
        step = second.step()
        step.append("new", [7])
        assert step.commit().num_rpcs == 0   # in-block: answered from the mirror
