"""The KV events stream through the real service over a real gRPC socket (docs/kv_events.md).

The main check: a randomized workload — prompts sharing prefixes (two salts), appends that
fill blocks, frees, evictions in small pools, offloads to a host tier, host evictions spilling
to a disk tier (which overwrites its LRU slots when full), disk onboards, disk blocks seeded at
registration, prefix fetches between the pools (placed admissions), swaps, failed step
reports, prefix-cache resets, defrag plans moving hashed blocks, a node re-registering —
journaled in a real SQLite file, with a block-manager restart in the middle; after every op
the subscriber's view (built only from the events) equals the block manager's prefix indexes
per node and tier (device, host, disk).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from block_manager.core import hash_prefix
from block_manager.service.server import BlockManagerServer
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from pagedkv.v1 import common_pb2
from tests.block_manager.service.kv_events_helpers import Subscriber, expected_view, step
from tests.block_manager.service.service_helpers import Harness, rid, service_config, step_request
from tests.support.polling import eventually

PREFIXES = [[7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
BLOCK_SIZE = 4   # the test config's


async def start(db: Path, **overrides: Any) -> Harness:
    server = BlockManagerServer(service_config(database_url=f"sqlite:///{db}", **overrides))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return Harness(server, channel, pb_grpc.BlockManagerStub(channel), pb_grpc.BlockManagerAdminStub(channel))


async def stop(h: Harness) -> None:
    await h.channel.close()
    await h.server.stop(0)


def disk_seeds(tokens: list[int], salt: str | None = None) -> list[common_pb2.DiskBlock]:
    """What a node's segment file would hold for `tokens`' full blocks (slots 0, 1, ...)."""
    hashes = hash_prefix(tokens, BLOCK_SIZE, salt)
    return [common_pb2.DiskBlock(slot=i, block_hash=hh, parent_hash=hashes[i - 1] if i else b"", salt=salt,
                                 token_ids=tokens[i * BLOCK_SIZE: (i + 1) * BLOCK_SIZE], last_used=i + 1)
            for i, hh in enumerate(hashes)]


async def register(h: Harness, node: str, num_blocks: int, host: int, disk: int, seeded: list[int]) -> None:
    """A node with a host tier and a disk tier under it whose segment file holds `seeded`."""
    await h.stub.RegisterNode(pb.RegisterNodeRequest(
        request_id=rid("reg"), node_id=node, num_blocks=num_blocks, host_num_blocks=host, disk_num_blocks=disk,
        disk_blocks=disk_seeds(seeded)))


async def drain(h: Harness, node: str, draining: bool) -> None:
    await h.admin.DrainNode(pb.DrainNodeRequest(request_id=rid("drain"), node_id=node, undrain=not draining))


def prompt(rng: random.Random) -> list[int]:
    return list(rng.choice(PREFIXES)) + [rng.randrange(50, 54) for _ in range(rng.randrange(0, 10))]


async def random_op(h: Harness, rng: random.Random, n: int) -> str:
    """One random op; returns its name. Item failures (out of blocks, pending writes) are fine:
    they change nothing, which the view check covers too."""
    core = h.server.runtime.state.core  # type: ignore[union-attr]
    live = sorted(s.seq_id for s in core.sequences())
    swapped = sorted(core.swapped_ids())
    r = rng.random()
    if r < 0.30 or not live:
        pool = rng.choice(["n1", "n1", "n2"])
        salt = rng.choice([None, None, "tenant-a"])
        await step(h, allocs=[(f"s{n}", pool, prompt(rng), 0, salt, 0)])
        return "alloc"
    if r < 0.38:   # prefix fetch: a prompt computed on n1; n1 drains; placed again, it lands on n2
        shared = rng.random() < 0.5     # one of the shared prefixes (n1 may lend host blocks), or a new one
        tokens = prompt(rng) if shared else [1000 + n] * 12 + [rng.randrange(50, 54)]
        await step(h, allocs=[(f"s{n}", "n1", tokens, 0, None, 0)])
        await step(h)   # reports the step that computed it: n1's blocks are written, lendable
        await drain(h, "n1", True)
        try:
            resp = await step(h, allocs=[(f"f{n}", "n1", tokens, 0, None, 0)], place=["n1", "n2"])
        finally:
            await drain(h, "n1", False)
        return "fetch" if any(ps.fetches for ps in resp.steps) else "placed"
    if r < 0.55:
        sid = rng.choice(live)
        await step(h, appends=[(sid, k, [rng.randrange(50, 54) for _ in range(k)]) for k in [rng.randrange(1, 6)]])
        return "append"
    if r < 0.72:
        await step(h, frees=rng.sample(live, min(len(live), rng.randrange(1, 3))))
        return "free"
    if r < 0.80:
        await step(h, swap_out=[rng.choice(live)])
        return "swap_out"
    if r < 0.86 and swapped:
        await step(h, swap_in=[rng.choice(swapped)])
        return "swap_in"
    if r < 0.91:
        await step(h, fail=rng.choice(["n1", "n2"]))
        return "fail"
    if r < 0.93:
        await h.admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id=rid("reset"), pool_id="n2"))
        return "reset"
    if r < 0.97:   # compaction: hashed blocks move to other ids (no event), committed with the next steps
        kind = rng.choice(["compaction", "contiguity"])
        try:
            await h.admin.TriggerDefrag(pb.TriggerDefragRequest(request_id=rid("defrag"), pool_id="n1", kind=kind))
        except grpc.aio.AioRpcError as exc:   # nothing to move, or a plan is outstanding
            assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED), exc
            return "defrag refused"
        return "defrag"
    h.reports.pop("n2", None)
    await register(h, "n2", num_blocks=12, host=4, disk=4, seeded=rng.choice(PREFIXES))
    return "reregister"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [1, 2])
async def test_replayed_events_equal_the_prefix_indexes_through_a_restart(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    db = tmp_path / "bm.db"
    h = await start(db)
    sub = Subscriber()
    try:
        # n1's disk seeds are in the first Resync's snapshot; n2's re-registrations publish theirs
        await register(h, "n1", num_blocks=16, host=6, disk=5, seeded=PREFIXES[2])
        await register(h, "n2", num_blocks=12, host=4, disk=4, seeded=PREFIXES[1])
        sub.start(h.stub)
        await sub.caught_up(h.server)
        assert ("n1", "disk") in sub.view.blocks and sub.view.blocks == expected_view(h.server)
        ops: dict[str, int] = {}
        for n in range(160):
            if n == 80:   # restart on the same journal; the subscriber reconnects with its last id
                last_id = sub.view.last_event_id
                await stop(h)
                await sub.stop()
                assert sub.ended in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, None)
                h2 = await start(db)
                h2.reports.update(h.reports)
                h = h2
                resyncs = sub.view.num_resyncs
                sub.start(h.stub)
                await sub.caught_up(h.server)
                assert sub.view.num_resyncs == resyncs + 1   # an id of the old process is not held: Resync
                assert sub.first_ids[-1] > last_id            # ids went on increasing
                assert sub.view.blocks == expected_view(h.server)
            name = await random_op(h, rng, n)
            ops[name] = ops.get(name, 0) + 1
            await sub.caught_up(h.server)
            assert sub.view.blocks == expected_view(h.server), f"after op {n} ({name})"
        # the workload did reach every kind of change, in all three tiers
        pool = h.server.runtime.state.core._pools["n1"]  # type: ignore[union-attr]
        assert pool.evictions > 0 and pool.host is not None and pool.host.offloaded_blocks > 0
        disk = pool.host.disk
        assert disk.disk_offloaded_blocks > 0 and disk.disk_evictions > 0 and disk.disk_onboarded_blocks > 0
        for kind in (("block_stored", "device"), ("block_stored", "host"), ("block_stored", "disk"),
                     ("block_removed", "device"), ("block_removed", "host"), ("block_removed", "disk"),
                     ("all_blocks_cleared", "all"), ("all_blocks_cleared", "device")):
            assert sub.kinds[kind] > 0, (kind, sub.kinds)
        assert ops.get("fetch", 0), ops   # n2 pulled n1's blocks: BlockStored on n2's device tier
        assert ops.get("fail", 0) and ops.get("reregister", 0) and ops.get("swap_out", 0), ops
        assert pool.defrag_moves > 0, ops   # hashed blocks moved to other ids: no event, views still equal
        assert sub.error is None
    finally:
        await sub.stop()
        await stop(h)


@pytest.mark.timeout(60)
async def test_a_step_whose_caller_gave_up_mid_commit_is_still_published(tmp_path: Path) -> None:
    """The Step's deadline passes while its journal transaction is in flight: the RPC ends
    DEADLINE_EXCEEDED, the record commits anyway, and so its events are published (after the
    commit, not when the cancelled handler would have resumed) — subscribers stay connected."""
    h = await start(tmp_path / "bm.db")
    sub = Subscriber()
    try:
        await h.register("n1", num_blocks=64)
        sub.start(h.stub)
        await sub.caught_up(h.server)
        hub = h.server.runtime.kv_events  # type: ignore[union-attr]
        published_before = hub.num_published
        store = h.server.runtime.store  # type: ignore[union-attr]
        release = threading.Event()
        real_append = store.append

        def slow_append(records: Any) -> Any:
            release.wait(30)
            return real_append(records)

        store.append = slow_append
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.Step(step_request(allocs=[("a", "n1", list(range(1, 14)), 0, None, 0)]), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert hub.num_published == published_before    # not before its commit
        release.set()
        await eventually(lambda: hub.num_published > published_before, what="the step's events published")
        await sub.caught_up(h.server)
        assert sub.ended is None and sub.view.num_resyncs == 1
        assert sub.view.blocks == expected_view(h.server) and len(sub.view.blocks[("n1", "device")]) == 3
    finally:
        await sub.stop()
        await stop(h)
