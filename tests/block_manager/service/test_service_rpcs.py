"""Every data-plane RPC against an in-process server, on the wire: results and error codes."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, expect_code, item_errors, rid, step_request

OK = grpc.StatusCode


async def test_register_node_returns_pool_epoch_lease(harness: Harness) -> None:
    r = await harness.register("n1", num_blocks=32)
    assert (r.pool_id, r.epoch, r.block_size, r.num_blocks) == ("n1", 1, 4, 32)
    assert r.lease_ttl_s == pytest.approx(30.0)
    assert r.prefetch_window == 4
    again = await harness.register("n1", num_blocks=32, block_size=8)
    assert (again.epoch, again.block_size) == (2, 8)


async def test_register_node_rejects_bad_input(harness: Harness) -> None:
    bad = [
        pb.RegisterNodeRequest(request_id=rid(), node_id="", num_blocks=8),
        pb.RegisterNodeRequest(request_id=rid(), node_id="has space", num_blocks=8),
        pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=0),
        pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=(1 << 20) + 1),
        pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=8, block_size=5000),
        pb.RegisterNodeRequest(request_id="", node_id="n1", num_blocks=8),
    ]
    for req in bad:
        await expect_code(harness.stub.RegisterNode(req), OK.INVALID_ARGUMENT)
    assert (await harness.admin.ListNodes(pb.ListNodesRequest())).nodes == []


async def test_step_allocations_prefix_hits_and_per_item_errors(harness: Harness) -> None:
    await harness.register("n1", num_blocks=8)
    prompt = list(range(100, 110))  # 10 tokens = 2 full blocks + 2
    first = await harness.allocate("a", tokens=prompt)
    assert (list(first.alloc_num_cached_tokens), list(first.alloc_num_tokens)) == ([0], [10])
    (ps,) = first.steps
    assert (ps.pool_id, ps.epoch, ps.step_id, ps.base_step_id) == ("n1", 1, 1, 0)
    assert list(ps.delta_seq_ids) == ["a"] and list(ps.delta_base_versions) == [0]
    assert list(ps.appended_blocks) == list(harness.table("a"))
    second = await harness.allocate("b", tokens=prompt)
    assert list(second.alloc_num_cached_tokens) == [8]
    assert harness.table("b")[:2] == harness.table("a")[:2]
    resp = await harness.step(allocs=[
        ("c", "n1", None, 4, None, 0),
        ("d", "nope", None, 4, None, 0),
        ("a", "n1", None, 4, None, 0),
        ("e", "n1", None, 400, None, 0),
        ("f", "n1", [1, 2, 3, 4, 5, 6], 0, None, 2),  # chunked: 2 tokens now
    ])
    errors = item_errors(resp, "alloc")
    assert {i: e.code for i, e in errors.items()} == {
        1: OK.NOT_FOUND.value[0], 2: OK.ALREADY_EXISTS.value[0], 3: OK.RESOURCE_EXHAUSTED.value[0]
    }
    assert errors[3].reason == "OutOfBlocks"
    assert list(resp.alloc_num_tokens) == [4, 0, 0, 0, 2]
    assert await harness.fsck() == []


async def test_whole_request_errors_change_nothing(harness: Harness) -> None:
    await harness.register("n1", num_blocks=8)
    await harness.allocate("x", num_tokens=3)
    await harness.flush()
    before = harness.state_snapshot()
    cases = [
        step_request(allocs=[("y", "n1", None, 1, None, 0), ("y", "n1", None, 1, None, 0)]),  # duplicate ids
        step_request(appends=[("x", 1), ("x", 1)]),  # an append section names a sequence twice
        step_request(allocs=[("y", "n1", None, 1, None, 0)], pool_epochs={"n1": 7}),  # stale epoch
        step_request(frees=["x", "ghost"]),  # frees are all or nothing
        step_request(appends=[("x", 2, [1])]),  # token ids for some tokens only
        step_request(scheduler_id=""),
        step_request(reports={"n1": (1, 99, 0)}),  # a step never handed out
    ]
    codes = [OK.INVALID_ARGUMENT, OK.INVALID_ARGUMENT, OK.FAILED_PRECONDITION, OK.NOT_FOUND,
             OK.INVALID_ARGUMENT, OK.INVALID_ARGUMENT, OK.FAILED_PRECONDITION]
    for req, code in zip(cases, codes, strict=True):
        await expect_code(harness.stub.Step(req), code)
        assert harness.state_snapshot() == before, req
    malformed = step_request(allocs=[("y", "n1", None, 1, None, 0)])
    malformed.alloc_pool_index[0] = 3
    await expect_code(harness.stub.Step(malformed), OK.INVALID_ARGUMENT)
    assert harness.state_snapshot() == before


async def test_appends_new_blocks_in_block_writes_and_failures(harness: Harness) -> None:
    await harness.register("n1", num_blocks=6)
    await harness.allocate("a", num_tokens=4)
    await harness.allocate("b", num_tokens=3)
    resp = await harness.append(("a", 1), ("b", 1), ("ghost", 1))
    assert list(resp.append_num_tokens) == [5, 4, 0]
    assert item_errors(resp, "append")[2].code == OK.NOT_FOUND.value[0]
    (ps,) = resp.steps
    # a new block changes a's table (a delta); a slot inside b's last block does not
    assert list(ps.delta_seq_ids) == ["a"] and list(ps.delta_num_appended) == [1] and not ps.replaced_blocks
    # Exhaust the pool: 6 blocks, 3 used; a needs 4 more blocks for 16 tokens.
    resp = await harness.append(("a", 16))
    assert item_errors(resp, "append")[0].code == OK.RESOURCE_EXHAUSTED.value[0]
    out = await harness.stub.Step(step_request(appends=[("a", 2, [1, 2]), ("b", 1, [3])]))
    assert not out.errors and list(out.append_num_tokens) == [7, 5]
    assert await harness.fsck() == []


async def test_fork_shares_blocks_and_cow_waits_for_the_written_step(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.allocate("p", num_tokens=6, forward=False)  # the Forward is not reported yet
    parent = harness.table("p")
    resp = await harness.step(forks=[("p", ["c1", "c2"])], appends=[("c1", 1)])
    assert harness.table("c1") == harness.table("c2") == parent
    err = item_errors(resp, "append")[0]
    assert (err.code, err.reason) == (OK.FAILED_PRECONDITION.value[0], "PendingWrite")
    harness.reports["n1"] = (1, 1, 0)  # now step 1's Forward ran
    resp = await harness.append(("c1", 1))
    (ps,) = resp.steps
    assert list(ps.copy_src) == [parent[-1]] and list(ps.copy_is_defrag) == [False]
    # c1 is announced in this step (the fork wrote nothing): its whole table, with the copy
    assert list(ps.delta_seq_ids) == ["c2", "c1"] or "c1" in ps.delta_seq_ids
    assert harness.table("c1")[-1] == ps.copy_dst[0]
    resp = await harness.fork("nope", "z")
    assert item_errors(resp, "fork")[0].code == OK.NOT_FOUND.value[0]
    resp = await harness.fork("p", "c1")
    assert item_errors(resp, "fork")[0].code == OK.ALREADY_EXISTS.value[0]
    await expect_code(harness.stub.Step(step_request(forks=[("p", ["q", "q"])])), OK.INVALID_ARGUMENT)


async def test_free_is_all_or_nothing_and_double_free_is_precondition(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.step(allocs=[("a", "n1", None, 5, None, 0), ("b", "n1", None, 5, None, 0)])
    before = harness.state_snapshot()
    await expect_code(harness.stub.Step(step_request(frees=["a", "ghost"])), OK.NOT_FOUND)
    assert harness.state_snapshot() == before
    await harness.free("a", "b")
    await expect_code(harness.free("a"), OK.FAILED_PRECONDITION)
    status = await harness.admin.Status(pb.StatusRequest())
    assert status.pools[0].num_used_blocks == 0


async def test_a_reported_failure_drops_the_steps_writers(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.allocate("keep", num_tokens=5)
    resp = await harness.allocate("lost", tokens=list(range(8)), forward=False)
    (ps,) = resp.steps
    out = await harness.step(reports={"n1": (1, ps.step_id - 1, ps.step_id)})
    (settled,) = out.settled
    assert list(settled.dropped_seq_ids) == ["lost"] and settled.settled_step == ps.step_id
    # its blocks were never written: no later prompt may hit them
    hit = await harness.allocate("again", tokens=list(range(9)))
    assert list(hit.alloc_num_cached_tokens) == [0]
    (nxt,) = hit.steps
    assert nxt.base_step_id == ps.step_id - 1 and "lost" in nxt.dropped_seq_ids
    await expect_code(harness.free("lost"), OK.FAILED_PRECONDITION)
    assert await harness.fsck() == []


async def test_get_tables_for_a_cold_cache(harness: Harness) -> None:
    reg = await harness.register("n1", num_blocks=16)
    await harness.allocate("a", num_tokens=4)
    resp = await harness.allocate("b", num_tokens=2)
    req = pb.GetTablesRequest(node_id="n1", epoch=reg.epoch, seq_ids=["a", "b"])
    got = await harness.stub.GetTables(req)
    assert {t.seq_id: tuple(t.block_table) for t in got.tables} == {"a": harness.table("a"), "b": harness.table("b")}
    assert got.last_step_id == resp.steps[0].step_id
    versions = {t.seq_id: t.version for t in got.tables}
    await harness.append(("a", 1))  # a gets a new block
    req.known_versions.update(versions)
    newer = (await harness.stub.GetTables(req)).tables
    assert [(t.seq_id, len(t.block_table)) for t in newer] == [("a", 2)]
    req.known_versions["b"] = versions["b"] + 1000
    await expect_code(harness.stub.GetTables(req), OK.ABORTED)
    await expect_code(
        harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch, seq_ids=["zz"])), OK.NOT_FOUND
    )
    await expect_code(
        harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch + 1)), OK.FAILED_PRECONDITION
    )
    await expect_code(harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=0)), OK.INVALID_ARGUMENT)
    await expect_code(harness.stub.GetTables(pb.GetTablesRequest(node_id="nx", epoch=1)), OK.NOT_FOUND)


async def test_one_scheduler_drives_a_pool(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    resp = await harness.allocate("a", num_tokens=3)
    assert dict(resp.lease_epochs) == {"n1": 1}
    other = step_request(scheduler_id="intruder", allocs=[("b", "n1", None, 3, None, 0)])
    err = await expect_code(harness.stub.Step(other), OK.FAILED_PRECONDITION)
    assert "sched-test" in (err.details() or "")
    await harness.free("a")
    await harness.step(release=True)  # the holder hands the pool back
    other.request_id = rid()
    taken = await harness.stub.Step(other)
    assert dict(taken.lease_epochs) == {"n1": 2}
    status = await harness.admin.Status(pb.StatusRequest())
    assert status.pools[0].scheduler_id == "intruder"


async def test_route_ranks_by_cached_prefix_then_free_space(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.register("n2", num_blocks=32)
    prompt = list(range(12))
    await harness.allocate("a", pool="n1", tokens=prompt)
    await harness.flush()   # a's Forward reported: its full blocks hold K/V and can be hit
    entries = (await harness.stub.Route(pb.RouteRequest(token_ids=prompt))).entries
    assert [e.pool_id for e in entries] == ["n1", "n2"]
    assert entries[0].num_cached_tokens == 8 and entries[0].address == "127.0.0.1:1"
    other = (await harness.stub.Route(pb.RouteRequest(token_ids=[999] * 12))).entries
    assert [e.pool_id for e in other] == ["n2", "n1"]
    salted = (await harness.stub.Route(pb.RouteRequest(token_ids=prompt, salt="tenant-b"))).entries
    assert all(e.num_cached_tokens == 0 for e in salted)
    batched = await harness.stub.Route(
        pb.RouteRequest(token_ids=prompt + [999] * 4, num_token_ids=[12, 4], salt_index=[-1, -1])
    )
    assert [r.entries[0].pool_id for r in batched.results] == ["n1", "n2"]
    await expect_code(harness.stub.Route(pb.RouteRequest()), OK.INVALID_ARGUMENT)
    await expect_code(harness.stub.Route(pb.RouteRequest(token_ids=[1], num_token_ids=[2])), OK.INVALID_ARGUMENT)


async def test_internal_errors_are_generic(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    await harness.register("n1")
    runtime = harness.server.runtime
    assert runtime is not None

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret detail")

    monkeypatch.setattr(runtime.state.core, "route", boom)
    err = await expect_code(harness.stub.Route(pb.RouteRequest(token_ids=[1])), OK.INTERNAL)
    assert "secret" not in (err.details() or "")
    assert (await harness.admin.Status(pb.StatusRequest())).state == "serving"


async def test_server_draining_is_unavailable(harness: Harness) -> None:
    await harness.register("n1")
    assert harness.server.runtime is not None
    harness.server.runtime.begin_drain()
    await expect_code(harness.allocate("a", num_tokens=1), OK.UNAVAILABLE)
    # reads still work while in-flight work drains
    assert (await harness.admin.Status(pb.StatusRequest())).state == "draining"
