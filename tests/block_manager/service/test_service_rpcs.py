"""Every data-plane RPC against an in-process server: results and error codes."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, expect_code, rid

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


async def test_allocate_with_prefix_cache_hit_and_per_item_errors(harness: Harness) -> None:
    await harness.register("n1", num_blocks=8)
    prompt = list(range(100, 110))  # 10 tokens = 2 full blocks + 2
    first = await harness.allocate("a", tokens=prompt)
    assert first.WhichOneof("outcome") == "allocation"
    assert len(first.allocation.block_table) == 3
    assert list(first.allocation.slot_mapping) == [
        b * 4 + o for b in first.allocation.block_table for o in range(4)
    ][:10]
    second = await harness.allocate("b", tokens=prompt)
    assert second.allocation.num_cached_tokens == 8
    assert list(second.allocation.block_table[:2]) == list(first.allocation.block_table[:2])

    resp = await harness.stub.Allocate(
        pb.AllocateRequest(
            request_id=rid(),
            items=[
                pb.AllocateItem(seq_id="c", pool_id="n1", num_tokens=4),
                pb.AllocateItem(seq_id="d", pool_id="nope", num_tokens=4),
                pb.AllocateItem(seq_id="a", pool_id="n1", num_tokens=4),
                pb.AllocateItem(seq_id="e", pool_id="n1", num_tokens=400),
                pb.AllocateItem(seq_id="f", pool_id="n1", num_tokens=4, token_ids=[1, 2, 3, 4]),
            ],
        )
    )
    kinds = [o.WhichOneof("outcome") for o in resp.outcomes]
    assert kinds == ["allocation", "error", "error", "error", "error"]
    codes = [o.error.code for o in resp.outcomes[1:]]
    assert codes == [
        OK.NOT_FOUND.value[0],
        OK.ALREADY_EXISTS.value[0],
        OK.RESOURCE_EXHAUSTED.value[0],
        OK.INVALID_ARGUMENT.value[0],
    ]
    assert resp.outcomes[3].error.reason == "OutOfBlocks"
    assert await harness.fsck() == []


async def test_allocate_request_level_errors_change_nothing(harness: Harness) -> None:
    await harness.register("n1", num_blocks=8)
    before = harness.state_snapshot()
    dup = pb.AllocateRequest(
        request_id=rid(),
        items=[
            pb.AllocateItem(seq_id="x", pool_id="n1", num_tokens=1),
            pb.AllocateItem(seq_id="x", pool_id="n1", num_tokens=1),
        ],
    )
    await expect_code(harness.stub.Allocate(dup), OK.INVALID_ARGUMENT)
    await expect_code(harness.stub.Allocate(pb.AllocateRequest(request_id=rid())), OK.INVALID_ARGUMENT)
    stale = pb.AllocateRequest(
        request_id=rid(), items=[pb.AllocateItem(seq_id="x", pool_id="n1", num_tokens=1)], pool_epochs={"n1": 7}
    )
    await expect_code(harness.stub.Allocate(stale), OK.FAILED_PRECONDITION)
    assert harness.state_snapshot() == before


async def test_append_slots_batch_new_blocks_and_failures(harness: Harness) -> None:
    await harness.register("n1", num_blocks=6)
    va = (await harness.allocate("a", num_tokens=4)).allocation.version
    vb = (await harness.allocate("b", num_tokens=3)).allocation.version
    resp = await harness.append(("a", 1), ("b", 1), ("ghost", 1))
    a, b, ghost = resp.outcomes
    # a new block changes the table (newer version); a slot inside the last block does not
    assert len(a.appended.new_block_ids) == 1 and a.appended.num_tokens == 5 and a.appended.version > va
    assert not b.appended.new_block_ids and b.appended.num_tokens == 4 and b.appended.version == vb
    assert ghost.error.code == OK.NOT_FOUND.value[0]
    # Exhaust the pool: 6 blocks, 3 used; a needs 4 more blocks for 16 tokens.
    resp = await harness.append(("a", 16))
    assert resp.outcomes[0].error.code == OK.RESOURCE_EXHAUSTED.value[0]
    await expect_code(harness.append(), OK.INVALID_ARGUMENT)
    dup = await harness.append(("b", 1), ("b", 1))
    assert dup.outcomes[0].WhichOneof("outcome") == "appended"
    assert dup.outcomes[1].error.code == OK.INVALID_ARGUMENT.value[0]
    bad_tokens = pb.AppendSlotsRequest(
        request_id=rid(), items=[pb.AppendItem(seq_id="a", num_new_tokens=2, token_ids=[1])]
    )
    out = await harness.stub.AppendSlots(bad_tokens)
    assert out.outcomes[0].error.code == OK.INVALID_ARGUMENT.value[0]
    assert await harness.fsck() == []


async def test_fork_shares_blocks_and_cow_on_write(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    parent = await harness.allocate("p", num_tokens=6)
    resp = await harness.stub.Fork(pb.ForkRequest(request_id=rid(), parent_seq_id="p", child_seq_ids=["c1", "c2"]))
    assert [c.seq_id for c in resp.children] == ["c1", "c2"]
    assert all(list(c.block_table) == list(parent.allocation.block_table) for c in resp.children)
    out = (await harness.append(("c1", 1))).outcomes[0].appended
    assert len(out.copy_ops) == 1 and out.copy_ops[0].kind == "cow"
    assert out.copy_ops[0].src == parent.allocation.block_table[-1]
    await expect_code(
        harness.stub.Fork(pb.ForkRequest(request_id=rid(), parent_seq_id="nope", child_seq_ids=["z"])), OK.NOT_FOUND
    )
    await expect_code(
        harness.stub.Fork(pb.ForkRequest(request_id=rid(), parent_seq_id="p", child_seq_ids=["c1"])), OK.ALREADY_EXISTS
    )
    await expect_code(harness.stub.Fork(pb.ForkRequest(request_id=rid(), parent_seq_id="p")), OK.INVALID_ARGUMENT)
    await expect_code(
        harness.stub.Fork(pb.ForkRequest(request_id=rid(), parent_seq_id="p", child_seq_ids=["q", "q"])),
        OK.INVALID_ARGUMENT,
    )


async def test_free_is_all_or_nothing_and_double_free_is_precondition(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.allocate("a", num_tokens=5)
    await harness.allocate("b", num_tokens=5)
    before = harness.state_snapshot()
    await expect_code(harness.stub.Free(pb.FreeRequest(request_id=rid(), seq_ids=["a", "ghost"])), OK.NOT_FOUND)
    assert harness.state_snapshot() == before
    resp = await harness.stub.Free(pb.FreeRequest(request_id=rid(), seq_ids=["a", "b"]))
    assert resp.num_freed == 2
    await expect_code(harness.stub.Free(pb.FreeRequest(request_id=rid(), seq_ids=["a"])), OK.FAILED_PRECONDITION)
    status = await harness.admin.Status(pb.StatusRequest())
    assert status.pools[0].num_used_blocks == 0


async def test_get_tables_only_newer_versions_and_pending_ops(harness: Harness) -> None:
    reg = await harness.register("n1", num_blocks=16)
    va = (await harness.allocate("a", num_tokens=4)).allocation.version
    vb = (await harness.allocate("b", num_tokens=2)).allocation.version
    req = pb.GetTablesRequest(node_id="n1", epoch=reg.epoch, seq_ids=["a", "b"])
    tables = (await harness.stub.GetTables(req)).tables
    assert {t.seq_id: t.version for t in tables} == {"a": va, "b": vb}
    new_va = (await harness.append(("a", 1))).outcomes[0].appended.version  # a gets a new block
    assert new_va > va
    req.known_versions.update({"a": va, "b": vb})
    newer = (await harness.stub.GetTables(req)).tables
    assert [(t.seq_id, t.version, len(t.block_table)) for t in newer] == [("a", new_va, 2)]
    req.known_versions["b"] = vb + 1000
    await expect_code(harness.stub.GetTables(req), OK.ABORTED)
    await expect_code(
        harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch, seq_ids=["zz"])), OK.NOT_FOUND
    )
    await expect_code(
        harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch + 1)), OK.FAILED_PRECONDITION
    )
    await expect_code(harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=0)), OK.INVALID_ARGUMENT)
    await expect_code(harness.stub.GetTables(pb.GetTablesRequest(node_id="nx", epoch=1)), OK.NOT_FOUND)


async def test_cow_ops_pending_until_acked(harness: Harness) -> None:
    reg = await harness.register("n1", num_blocks=16)
    await harness.allocate("p", num_tokens=2)
    await harness.stub.Fork(pb.ForkRequest(request_id=rid(), parent_seq_id="p", child_seq_ids=["c"]))
    op = (await harness.append(("c", 1))).outcomes[0].appended.copy_ops[0]
    tables = await harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch))
    assert [o.op_id for o in tables.copy_ops] == [op.op_id]
    hb = await harness.stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=reg.epoch))
    assert hb.last_pending_op_id == op.op_id
    after = await harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch, after_op_id=op.op_id))
    assert list(after.copy_ops) == []
    await expect_code(
        harness.stub.AckCopyOps(
            pb.AckCopyOpsRequest(request_id=rid(), node_id="n1", epoch=reg.epoch, up_to_op_id=op.op_id + 5)
        ),
        OK.INVALID_ARGUMENT,
    )
    await harness.stub.AckCopyOps(
        pb.AckCopyOpsRequest(request_id=rid(), node_id="n1", epoch=reg.epoch, up_to_op_id=op.op_id)
    )
    tables = await harness.stub.GetTables(pb.GetTablesRequest(node_id="n1", epoch=reg.epoch))
    assert list(tables.copy_ops) == []
    assert (await harness.stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=reg.epoch))).last_pending_op_id == 0
    await expect_code(
        harness.stub.AckCopyOps(
            pb.AckCopyOpsRequest(request_id=rid(), node_id="n1", epoch=reg.epoch + 1, up_to_op_id=1)
        ),
        OK.FAILED_PRECONDITION,
    )


async def test_route_ranks_by_cached_prefix_then_free_space(harness: Harness) -> None:
    await harness.register("n1", num_blocks=16)
    await harness.register("n2", num_blocks=32)
    prompt = list(range(12))
    await harness.allocate("a", pool="n1", tokens=prompt)
    entries = (await harness.stub.Route(pb.RouteRequest(token_ids=prompt))).entries
    assert [e.pool_id for e in entries] == ["n1", "n2"]
    assert entries[0].num_cached_tokens == 8 and entries[0].address == "127.0.0.1:1"
    other = (await harness.stub.Route(pb.RouteRequest(token_ids=[999] * 12))).entries
    assert [e.pool_id for e in other] == ["n2", "n1"]
    salted = (await harness.stub.Route(pb.RouteRequest(token_ids=prompt, salt="tenant-b"))).entries
    assert all(e.num_cached_tokens == 0 for e in salted)
    await expect_code(harness.stub.Route(pb.RouteRequest()), OK.INVALID_ARGUMENT)


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
