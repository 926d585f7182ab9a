"""The disk tier's ledger rule by rule (block_manager/core/disk_tier.py; the three-tier state
machine below mixes them with everything else): host LRU eviction spills written hashed blocks
to disk, a prefix on disk is staged disk->host->device in one step, disk sources are held until
that step is reported, a failed step forgets what it spilled, seeded blocks (a node restart)
are hits at once and are checked against their hashes, and the disk is bounded with LRU reuse."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from block_manager.core import BlockManager, InvalidRequest, StepOutput, hash_prefix
from block_manager.core.disk_tier import SeedBlock
from block_manager.core.kv_events import apply_change
from tests.block_manager.core import test_core_stateful as base
from tests.block_manager.core import test_core_tiers_stateful as tiers

BS = 4


def _manager(num_blocks: int = 4, host: int = 2, disk: int = 4, seeds: tuple = ()) -> BlockManager:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", num_blocks, BS, host_num_blocks=host, disk_num_blocks=disk, disk_blocks=seeds)
    return m


def _run(m: BlockManager, *, force: bool = False) -> StepOutput:
    out = m.close_step("p", force=force)
    assert out is not None
    m.settle_steps("p", out.step_id)
    return out


def _push_to_disk(m: BlockManager, prompt: list[int], others: tuple[int, ...] = (50, 60)) -> None:
    """Compute `prompt`, free it, evict it off the device (to host), then push it off host
    with other prefixes (to disk)."""
    m.allocate("a", "p", prompt)
    _run(m)
    m.free(["a"])
    m.evict("p", 4)
    _run(m, force=True)
    for i, first in enumerate(others):           # more prefixes through the 2-block host tier
        m.allocate(f"x{i}", "p", [first + t for t in range(9)])
        _run(m)
        m.free([f"x{i}"])
        m.evict("p", 4)
        _run(m, force=True)


def test_host_eviction_spills_to_disk_and_a_disk_hit_onboards_in_one_step() -> None:
    m = _manager()
    prompt = list(range(1, 10))                   # 2 full hashed blocks + 1 token
    _push_to_disk(m, prompt)
    disk = m.disk_metrics("p")
    assert disk.disk_offloaded_blocks >= 2 and disk.num_cached_blocks >= 2
    r = m.allocate("b", "p", prompt)
    assert r.num_cached_tokens == 8               # both full blocks served from disk
    out = m.close_step("p")
    kinds = [op.kind for op in out.tier_ops]
    assert kinds.count("disk_onboard") == 2 and kinds.count("onboard") == 2
    loads = [op for op in out.tier_ops if op.kind == "disk_onboard"]
    onboards = [op for op in out.tier_ops if op.kind == "onboard"]
    assert [op.dst for op in loads] == [op.src for op in onboards]   # disk -> host -> device
    assert [op.dst for op in onboards] == list(r.block_table[:2])
    assert m.disk_metrics("p").disk_hit_tokens == 8 and m.host_metrics("p").host_hit_tokens == 0
    assert m.fsck() == []
    m.settle_steps("p", out.step_id)
    assert m.fsck() == []


def test_disk_offloads_carry_the_block_identity_the_node_stores() -> None:
    m = _manager()
    prompt = list(range(1, 10))
    hashes = hash_prefix(prompt, BS, None)
    m.allocate("a", "p", prompt)
    _run(m)
    m.free(["a"])
    m.evict("p", 4)
    _run(m, force=True)
    m.allocate("x", "p", list(range(50, 59)))
    _run(m)
    m.free(["x"])
    m.evict("p", 4)                               # host full: its LRU blocks (the prompt's) spill
    out = m.close_step("p", force=True)
    spills = [op for op in out.tier_ops if op.kind == "disk_offload"]
    by_hash = {op.meta.block_hash: op.meta for op in spills}
    assert sorted(by_hash) == sorted(hashes)
    assert by_hash[hashes[0]].parent_hash is None and by_hash[hashes[1]].parent_hash == hashes[0]
    assert by_hash[hashes[1]].token_ids == (5, 6, 7, 8) and by_hash[hashes[1]].salt is None


def test_disk_sources_are_held_until_the_reading_step_is_reported() -> None:
    m = _manager(disk=2)
    prompt = list(range(1, 10))
    _push_to_disk(m, prompt, others=(50,))
    r = m.allocate("b", "p", prompt)
    assert r.num_cached_tokens == 8
    # the disk is full (2 slots) and both are read by the open step: no spill may take them
    assert m.disk_metrics("p").num_cached_blocks == 0
    out = m.close_step("p")
    assert m.disk_metrics("p").num_cached_blocks == 0   # still held: the step is in flight
    m.settle_steps("p", out.step_id)
    assert m.disk_metrics("p").num_cached_blocks == 2 and m.fsck() == []


def test_a_failed_step_forgets_what_it_spilled_to_disk() -> None:
    m = _manager()
    prompt = list(range(1, 10))
    m.allocate("a", "p", prompt)
    _run(m)
    m.free(["a"])
    m.evict("p", 4)
    _run(m, force=True)
    m.allocate("x", "p", list(range(50, 59)))
    _run(m)
    m.free(["x"])
    m.evict("p", 4)
    out = m.close_step("p", force=True)
    assert any(op.kind == "disk_offload" for op in out.tier_ops)
    m.settle_steps("p", out.step_id - 1, failed_from=out.step_id)
    assert m.disk_metrics("p").num_cached_blocks == 0     # never written: never a hit
    r = m.allocate("b", "p", prompt)
    assert r.num_cached_tokens == 0 and m.fsck() == []


def test_the_disk_is_bounded_and_reuses_its_least_recently_used_slots() -> None:
    m = _manager(disk=2)
    for i, first in enumerate((10, 20, 30, 40)):
        m.allocate(f"s{i}", "p", [first + t for t in range(9)])
        _run(m)
        m.free([f"s{i}"])
        m.evict("p", 4)
        _run(m, force=True)
    d = m.disk_metrics("p")
    assert d.num_cached_blocks == 2 and d.disk_evictions > 0 and m.fsck() == []
    assert m.allocate("old", "p", [10 + t for t in range(9)]).num_cached_tokens == 0


def test_seeded_blocks_are_hits_at_once_and_checked_against_their_hash() -> None:
    prompt = list(range(1, 10))
    h = hash_prefix(prompt, BS, "t")
    seeds = (SeedBlock(3, h[0], None, "t", (1, 2, 3, 4), 1), SeedBlock(0, h[1], h[0], "t", (5, 6, 7, 8), 2))
    m = _manager(seeds=seeds)
    assert m.disk_metrics("p").num_cached_blocks == 2
    assert m.allocate("x", "p", prompt).num_cached_tokens == 0           # no salt: another tenant
    _run(m)
    m.free(["x"])
    assert m.allocate("b", "p", prompt, salt="t").num_cached_tokens == 8
    assert m.fsck() == []
    bad = (SeedBlock(1, h[1], h[0], "t", (5, 6, 7, 9), 1), SeedBlock(2, h[0], None, "t", (1, 2, 3, 4), 1))
    m = _manager(seeds=bad)                       # the block whose hash does not add up is left out
    assert m.disk_metrics("p").num_cached_blocks == 1 and m.fsck() == []
    with pytest.raises(InvalidRequest, match="tokens"):
        _manager(seeds=(SeedBlock(1, h[0], None, "t", (1, 2, 3)),))
    with pytest.raises(InvalidRequest, match="outside"):
        _manager(seeds=(SeedBlock(9, h[0], None, "t", (1, 2, 3, 4)),))
    with pytest.raises(InvalidRequest, match="needs a host tier"):
        BlockManager().add_pool("p", 4, BS, disk_num_blocks=4)


def test_seeds_and_a_removed_pool_are_kv_changes_of_the_disk_tier() -> None:
    """A recording manager (the KV events' source) reports a registration's seeds as disk-tier
    stores, the hash that does not add up not at all, a refused registration nothing, and a
    removed pool as one clear of every tier; the disk index is in `kv_index_view`."""
    prompt = list(range(1, 10))
    h = hash_prefix(prompt, BS, None)
    m = BlockManager(watermark=0.0)
    m.record_kv_changes()
    with pytest.raises(InvalidRequest, match="outside"):
        m.add_pool("p", 4, BS, host_num_blocks=2, disk_num_blocks=4, disk_blocks=(
            SeedBlock(0, h[0], None, None, (1, 2, 3, 4)), SeedBlock(9, h[1], h[0], None, (5, 6, 7, 8))))
    assert m.take_kv_changes() == [] and m.kv_index_view() == {}
    m.add_pool("p", 4, BS, host_num_blocks=2, disk_num_blocks=4, disk_blocks=(
        SeedBlock(3, h[0], None, None, (1, 2, 3, 4), 1), SeedBlock(0, h[1], h[0], None, (5, 6, 7, 8), 2),
        SeedBlock(1, h[1], h[0], None, (5, 6, 7, 9), 3)))   # content that is not its hash: left out
    assert m.take_kv_changes() == [("stored", "p", "disk", h[0], None, None, 4, (1, 2, 3, 4)),
                                   ("stored", "p", "disk", h[1], h[0], None, 4, (5, 6, 7, 8))]
    assert m.kv_index_view() == {("p", "disk"): {h[0]: (None, None, 4), h[1]: (h[0], None, 4)}}
    m.remove_pool("p")
    assert m.take_kv_changes() == [("cleared", "p", None)] and m.kv_index_view() == {}


def test_a_snapshot_keeps_the_disk_tier() -> None:
    m = _manager()
    _push_to_disk(m, list(range(1, 10)))
    m.allocate("b", "p", list(range(1, 10)))
    snap = m.to_snapshot()
    again = BlockManager.from_snapshot(snap)
    assert again.to_snapshot() == snap and again.fsck() == []
    assert again.disk_metrics("p") == m.disk_metrics("p")


# ---- the two-tier Hypothesis machine with a disk tier under every host tier ----------------
DISK_BLOCKS = {"p": 16, "q": 6}
EVENTS: Counter[str] = Counter()


@dataclass
class DiskNode(tiers.TierNode):
    disk: dict[int, int] = field(default_factory=dict)

    def apply(self, out: StepOutput) -> None:
        bs = self.block_size

        def move(src_mem: dict[int, int], dst_mem: dict[int, int], ops) -> None:
            staged = [(op.dst, [src_mem.get(op.src * bs + o) for o in range(bs)]) for op in ops]
            for dst, vals in staged:
                for o, v in enumerate(vals):
                    if v is None:
                        dst_mem.pop(dst * bs + o, None)
                    else:
                        dst_mem[dst * bs + o] = v

        ops = out.tier_ops
        # the node's order: host->disk, device->host, disk->host, host->device
        move(self.host, self.disk, [op for op in ops if op.kind == "disk_offload"])
        move(self.mem, self.host, [op for op in ops if op.kind in ("swap_out", "offload")])
        move(self.disk, self.host, [op for op in ops if op.kind == "disk_onboard"])
        move(self.host, self.mem, [op for op in ops if op.kind in ("swap_in", "onboard")])
        EVENTS["disk_offload"] += any(op.kind == "disk_offload" for op in ops)
        EVENTS["disk_onboard"] += any(op.kind == "disk_onboard" for op in ops)
        base.ShadowNode.apply(self, out)


class DiskMachine(tiers.TierMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(watermark=0.1)
        for pid, (n, bs) in base.POOLS.items():
            self.m.add_pool(pid, n, bs, host_num_blocks=tiers.HOST_BLOCKS[pid], disk_num_blocks=DISK_BLOCKS[pid])
        self.nodes = {pid: DiskNode(bs) for pid, (_, bs) in base.POOLS.items()}
        self.kv_core: BlockManager | None = None   # the manager whose changes `kv_view` replays

    @invariant()
    def kv_changes_replay_to_every_tiers_index(self) -> None:
        """The recorded prefix-index changes (the KV events' source, core/kv_events.py), replayed
        in order, equal every tier's index (device, host, disk) after every rule. A manager
        restored from a snapshot starts recording from its own index (a subscriber's Resync)."""
        if self.m is not self.kv_core:
            self.kv_core = self.m
            self.m.record_kv_changes()
            self.kv_view = {k: dict(v) for k, v in self.m.kv_index_view().items()}
            return
        changes = self.m.take_kv_changes()
        for change in changes:
            apply_change(self.kv_view, change)
        EVENTS.update(f"kv {c[0]} {c[2]}" for c in changes)
        assert self.kv_view == self.m.kv_index_view()

    @rule(pid=st.sampled_from(sorted(base.POOLS)), prefix=st.integers(0, 2), salt=st.sampled_from(base.SALTS),
          fill=st.integers(2, 5))
    def through_disk(self, pid, prefix, salt, fill) -> None:
        """A prefix computed, freed, evicted off the device (to host), pushed off host by other
        prompts' blocks (to disk), and asked for again: a disk onboard when the disk kept it."""
        self.forward(pid, False)
        sid = f"s{self.next_seq + 1}"
        self.allocate(pid, prefix, 24, [1], salt, True)
        self.forward(pid, False)
        if sid in self.expected and sid not in self.pending:
            self.m.free([sid])
            self.forget(sid)
        self.m.evict(pid, 64)
        self.forward(pid, False)
        for k in range(fill):   # other prompts, each freed and evicted: their blocks push the host tier
            other = f"s{self.next_seq + 1}"
            self.allocate(pid, 0, 0, [300 + 37 * k + self.next_seq + t for t in range(20)], None, True)
            self.forward(pid, False)
            if other in self.expected and other not in self.pending:
                self.m.free([other])
                self.forget(other)
            self.m.evict(pid, 64)
            self.forward(pid, False)
        self.allocate(pid, prefix, 24, [1], salt, True)


def run_disk_machine(max_examples: int, steps: int, derandomize: bool) -> None:
    EVENTS.clear()
    run_state_machine_as_test(
        DiskMachine,
        settings=settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                          derandomize=derandomize, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]),
    )
    print(dict(EVENTS))
    assert EVENTS["disk_offload"] > 0 and EVENTS["disk_onboard"] > 0, dict(EVENTS)
    for tier in ("device", "host", "disk"):
        assert EVENTS[f"kv stored {tier}"] > 0 and EVENTS[f"kv removed {tier}"] > 0, dict(EVENTS)


def test_three_tier_core_state_machine() -> None:
    """Everything the two-tier machine checks (tokens read back through the node's tables after
    every rule, fsck of every tier, failed calls change nothing, snapshots round-trip), with
    host evictions spilling to disk and prefixes coming back from it."""
    run_disk_machine(max_examples=15, steps=40, derandomize=True)   # --slow: 300 x 60, random seeds


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_three_tier_core_state_machine_long() -> None:
    run_disk_machine(max_examples=300, steps=60, derandomize=False)
