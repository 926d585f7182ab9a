"""A scripted multi-sequence workload through a real block manager and a real compute node.

Every attention output of every step is compared with the float64 reference over the test's
own shadow of each sequence's K/V history (`Scheduler.forward`), so prefix sharing, mixed
decode/prefill batches, copy-on-write after forks, frees and defrag moves inside the node may
not change a single result. The node never asks the block manager for a table: each
Forward carries the pool's steps since the previous one.
"""

from __future__ import annotations

import numpy as np

from pagedkv.v1 import block_manager_pb2 as bm_pb
from pagedkv.v1 import block_manager_pb2_grpc as bm_grpc
from tests.compute_node.harness import BLOCK_SIZE, Scheduler, rid, start_bm, start_node

PREFIX = list(range(100, 112))   # 12 tokens = 3 full blocks, shared by two prompts




async def test_shared_prefix_mixed_batches_and_cow_fork(cluster) -> None:  # type: ignore[no-untyped-def]
    s: Scheduler = cluster.sched
    a = await s.allocate("a", PREFIX + [1, 2, 3])
    await s.forward([a])
    assert s.last_stats.num_block_manager_rpcs == 0          # the table came with the step

    b = await s.allocate("b", PREFIX + [7, 8, 9, 10, 11])
    assert s.seqs["b"].num_tokens == 12                         # prefix-cache hit: 3 blocks shared
    assert b.num_new_tokens == 5
    solo = await s.allocate("solo", [5, 6, 7, 8, 9, 10, 11])
    # Mixed batch: decode, prefill, decode, prefill (scattered back in request order); the
    # Forward carries the three steps the three calls produced, in order.
    d = await s.append(["a"])
    assert len(s.pending) == 3
    await s.forward([d[0], b, solo])
    for _ in range(7):                                          # crosses block boundaries
        await s.forward(await s.append(["a", "b", "solo"]))
        assert s.last_stats.num_block_manager_rpcs == 0         # never a table fetch

    # Fork: children share every block; the partial last block is copied on first write.
    await s.fork("a", ["a1", "a2"])
    steps = await s.append(["a", "a1", "a2"])
    await s.forward(steps)
    assert s.last_stats.num_copy_ops >= 1                       # CoW applied before the write
    outs = [o for o in (await s.forward(await s.append(["a", "a1", "a2"])))]
    assert not np.allclose(outs[0], outs[1])                    # children diverged
    # The parent is untouched by its children's writes: its next steps still match its shadow.
    for _ in range(3):
        await s.forward(await s.append(["a", "b"]))

    await s.free(["solo", "a2"])
    assert cluster.node.node.tables.get("solo") is not None     # the drop rides in the next step
    await s.forward(await s.append(["a", "a1", "b"]))
    assert cluster.node.node.tables.get("solo") is None and cluster.node.node.tables.get("a2") is None


async def test_defrag_moves_ride_in_a_step_and_keep_outputs_identical() -> None:
    bm = await start_bm()
    node = await start_node(bm.address)
    s = Scheduler(bm.address, node.address, "node-a", seed=1)
    admin = bm_grpc.BlockManagerAdminStub(s.client._channel)
    try:
        # Fill low block ids with sequences we then free, so live full blocks sit high.
        fillers = [await s.allocate(f"f{i}", [i] * 8) for i in range(4)]
        await s.forward(fillers)
        keep = [await s.allocate(f"k{i}", [50 + i] * 8) for i in range(3)]
        await s.forward(keep)
        await s.free([f"f{i}" for i in range(4)])   # also reports the Forward: k's blocks are written
        reply = await admin.TriggerDefrag(bm_pb.TriggerDefragRequest(request_id=rid("defrag"), pool_id="node-a"))
        (plan,) = reply.plans
        assert len(plan.moves) > 0
        cn = node.node

        # The plan rides in the next step: its copies run inside the Forward, before the writes,
        # and every output still matches the reference over the shadow history.
        steps = await s.append([f"k{i}" for i in range(3)])     # each needs a new block: a Step RPC
        assert s.pending[-1].plan_id == plan.plan_id and len(s.pending[-1].copy_ops) == len(plan.moves)
        await s.forward(steps)
        assert s.last_stats.num_copy_ops == len(plan.moves) and s.last_stats.num_block_manager_rpcs == 0
        res = await s.client.flush_reports()                    # the report commits the plan
        assert res is not None and plan.plan_id in res.settled["node-a"].committed_plan_ids
        # The tables switch to the copies in the open step (full blocks are never written again,
        # so reading the sources until then is exact); the next step that writes delivers them,
        # and the workload goes on over the moved blocks.
        for _ in range(BLOCK_SIZE + 1):
            await s.forward(await s.append([f"k{i}" for i in range(3)]))
        new_tables = {f"k{i}": cn.tables.get(f"k{i}").block_table for i in range(3)}
        assert {m.dst for m in plan.moves} <= {b for t in new_tables.values() for b in t}
        assert not {m.src for m in plan.moves} & {b for t in new_tables.values() for b in t}
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_compaction_between_a_step_and_its_forward() -> None:
    """Issue 9's deterministic repro, end to end: an admin compaction issued after a step was
    answered and before its Forward ran. The sequences that Forward is about to write must not
    move (their K/V is not written yet); once reported, they may. Every output is checked."""
    bm = await start_bm()
    node = await start_node(bm.address)
    s = Scheduler(bm.address, node.address, "node-a", seed=4)
    admin = bm_grpc.BlockManagerAdminStub(s.client._channel)

    async def compact() -> bm_pb.TriggerDefragResponse:
        return await admin.TriggerDefrag(bm_pb.TriggerDefragRequest(request_id=rid("defrag"), pool_id="node-a"))

    try:
        fillers = [await s.allocate(f"f{i}", [i] * 8) for i in range(3)]
        await s.forward(fillers)
        await s.free([f"f{i}" for i in range(3)])                 # a hole of 6 blocks at the bottom
        fresh = [await s.allocate(f"n{i}", list(range(10 * i, 10 * i + 9))) for i in range(2)]
        fresh_blocks = {b for i in range(2) for b in s.client.tracker.get(f"n{i}").block_table}
        plans = (await compact()).plans
        assert all(m.src not in fresh_blocks for p in plans for m in p.moves)   # unwritten: they stay
        await s.forward(fresh)                                    # outputs checked against float64
        await s.forward(await s.append(["n0", "n1"]))
        res = await s.client.flush_reports()
        assert res is None or not res.dropped
        plans = (await compact()).plans                           # written now: they may move
        assert plans and {m.src for p in plans for m in p.moves} & fresh_blocks
        for _ in range(2 * BLOCK_SIZE):                           # the moves ride in, commit, tables switch
            await s.forward(await s.append(["n0", "n1"]))
        status = await admin.Status(bm_pb.StatusRequest())
        assert status.pools[0].compaction_plans >= 1 and status.pools[0].aborted_plans == 0
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)


async def test_float16_pool_prefill_and_decode() -> None:
    bm = await start_bm()
    geometry = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float16"}
    node = await start_node(bm.address, geometry=geometry)
    s = Scheduler(bm.address, node.address, "node-a", seed=5, dtype="float16")
    try:
        await s.forward([await s.allocate("h", list(range(11)))], atol=3e-3)
        for _ in range(6):
            await s.forward(await s.append(["h"]), atol=3e-3)
        assert str(node.node.pool.key_caches[0].dtype) == "torch.float16"
    finally:
        await s.close()
        await node.stop(0)
        await bm.stop(0)
