"""A scripted multi-sequence workload through a real block manager and a real compute node.

Every attention output of every step is compared with the float64 reference over the test's
own shadow of each sequence's K/V history (`Scheduler.forward`), so prefix sharing, mixed
decode/prefill batches, copy-on-write after forks, frees and defrag moves inside the node may
not change a single result.
"""

from __future__ import annotations

import numpy as np

from pagedkv.v1 import block_manager_pb2 as bm_pb
from tests.compute_node.harness import BLOCK_SIZE, Scheduler, rid, start_bm, start_node
from tests.support.polling import eventually

PREFIX = list(range(100, 112))   # 12 tokens = 3 full blocks, shared by two prompts




async def test_shared_prefix_mixed_batches_and_cow_fork(cluster) -> None:  # type: ignore[no-untyped-def]
    s: Scheduler = cluster.sched
    a = await s.allocate("a", PREFIX + [1, 2, 3])
    await s.forward([a])
    assert s.last_stats.num_block_manager_rpcs == 1          # one GetTables for the new table

    b = await s.allocate("b", PREFIX + [7, 8, 9, 10, 11])
    assert s.seqs["b"].num_tokens == 12                         # prefix-cache hit: 3 blocks shared
    assert len(b.slot_mapping) == 5
    solo = await s.allocate("solo", [5, 6, 7, 8, 9, 10, 11])
    # Mixed batch: decode, prefill, decode, prefill (scattered back in request order).
    d = await s.append(["a"])
    await s.forward([d[0], b, solo])
    for _ in range(6):                                          # crosses block boundaries
        await s.forward(await s.append(["a", "b", "solo"]))
    await s.forward(await s.append(["a", "b", "solo"]))
    assert s.last_stats.num_block_manager_rpcs == 0             # steady decode: warm cache

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
    await s.forward(await s.append(["a", "a1", "b"]), freed_seq_ids=["solo", "a2"])
    assert cluster.node.node.tables.get("solo") is None


async def test_defrag_moves_keep_outputs_identical() -> None:
    # A short lease makes the heartbeat (every ttl/3) notice the plan's moves promptly.
    bm = await start_bm(lease_ttl_s=3.0)
    node = await start_node(bm.address)
    s = Scheduler(bm.address, node.address, "node-a", seed=1)
    try:
        # Fill low block ids with sequences we then free, so live full blocks sit high.
        fillers = [await s.allocate(f"f{i}", [i] * 8) for i in range(4)]
        await s.forward(fillers)
        keep = [await s.allocate(f"k{i}", [50 + i] * 9) for i in range(3)]
        await s.forward(keep)
        await s.free([f"f{i}" for i in range(4)])
        steps = await s.append([f"k{i}" for i in range(3)])
        request = s.request(steps)
        before = await s.node.Forward(request)
        for st in steps:
            s._commit(st)

        plan = (await s.bm.PlanDefrag(bm_pb.PlanDefragRequest(request_id=rid("plan"), pool_id="node-a"))).plan
        assert len(plan.moves) > 0
        last_move = max(m.op_id for m in plan.moves)
        cn = node.node
        old_tables = {f"k{i}": cn.tables.get(f"k{i}").block_table for i in range(3)}
        await eventually(lambda: cn.last_acked_op_id >= last_move, timeout_s=10.0)   # heartbeat → apply → ack

        # Retrying the same step (same slots: only full blocks move) reads the moved blocks.
        after = await s.node.Forward(request)
        assert after.stats.num_block_manager_rpcs == 1            # suspect tables re-checked once
        for o1, o2 in zip(before.outputs, after.outputs):
            assert o1.output.data == o2.output.data               # bit-identical
        new_tables = {f"k{i}": cn.tables.get(f"k{i}").block_table for i in range(3)}
        assert new_tables != old_tables
        moved_to = {m.dst for m in plan.moves}
        assert moved_to & {b for t in new_tables.values() for b in t}
        # And the workload goes on over the moved blocks.
        for _ in range(BLOCK_SIZE + 1):
            await s.forward(await s.append([f"k{i}" for i in range(3)]))
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
