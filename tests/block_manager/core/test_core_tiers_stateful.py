"""The two-tier core under the same Hypothesis machine as `test_core_stateful.py`, with a host
tier under every pool and swap-out / swap-in / offload (by eviction under pressure) / onboard
(by allocation with a host hit) interleaved with appends, forks, frees, defrag, evictions,
failed steps and snapshots.

The shadow node now has host memory too and applies a step's tier ops the way the compute node
does: all device->host moves first (sources read before anything writes), then all host->device
moves, then the copy ops, then the writes; and it checks that no two moves of a step write one
block and that no copy names a block a host->device move writes. After every rule: fsck of
both tiers (each block in exactly one place per tier, ref counts = swapped tables + holds, no
block both free and mapped, the host and device indexes agree), host ref counts recomputed
here, and every sequence — also one swapped out and back, or built on an onboarded prefix —
reads back its tokens on the node.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from block_manager.core import (
    BlockManager,
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    PendingWrite,
    StepOutput,
    UnknownSequence,
)
from tests.block_manager.core import test_core_stateful as base

HOST_BLOCKS = {"p": 24, "q": 10}
EVENTS: Counter[str] = Counter()


@dataclass
class TierNode(base.ShadowNode):
    host: dict[int, int] = field(default_factory=dict)

    def apply(self, out: StepOutput) -> None:
        bs = self.block_size

        def move(src_mem: dict[int, int], dst_mem: dict[int, int], ops) -> None:
            # batched like the node: read every source, then write every destination
            staged = [(op.dst, [src_mem.get(op.src * bs + o) for o in range(bs)]) for op in ops]
            for dst, vals in staged:
                for o, v in enumerate(vals):
                    if v is None:
                        dst_mem.pop(dst * bs + o, None)
                    else:
                        dst_mem[dst * bs + o] = v

        # the step's moves never fight over a block (test_core_step_order.py): a batched
        # scatter with two writes into one block has no defined winner on CUDA, and a copy runs
        # after the host->device moves (it must neither read nor overwrite what they wrote)
        to_device = [op.dst for op in out.tier_ops if op.kind in ("swap_in", "onboard")]
        to_host = [op.dst for op in out.tier_ops if op.to_host]
        copied = {b for op in out.copy_ops for b in (op.src, op.dst)}
        assert len(set(to_device)) == len(to_device) and not copied & set(to_device), out
        assert len(set(to_host)) == len(to_host), out
        move(self.mem, self.host, [op for op in out.tier_ops if op.to_host])
        move(self.host, self.mem, [op for op in out.tier_ops if not op.to_host])
        super().apply(out)


class TierMachine(base.CoreMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(watermark=0.1)
        for pid, (n, bs) in base.POOLS.items():
            self.m.add_pool(pid, n, bs, host_num_blocks=HOST_BLOCKS[pid])
        self.nodes = {pid: TierNode(bs) for pid, (_, bs) in base.POOLS.items()}
        self.swapped: dict[str, list[int]] = {}   # swapped-out seq -> its tokens

    def forget(self, sid: str) -> None:
        if sid in self.swapped:
            del self.swapped[sid]
            del self.pool_of[sid]
            return
        super().forget(sid)

    @precondition(lambda self: bool(self.expected))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.expected)), min_size=1, max_size=3, unique=True))
        # forks of one parent swapped together share host blocks
        before = self.m.to_snapshot()
        can = self.m.can_swap_out(ids)
        try:
            self.m.swap_out(ids)
        except (PendingWrite, OutOfBlocks) as exc:
            EVENTS[f"swap_out_{type(exc).__name__}"] += 1
            assert not can
            assert self.m.to_snapshot() == before
            return
        assert can
        EVENTS["swap_out"] += 1
        for sid in ids:
            assert sid not in self.pending
            self.swapped[sid] = self.expected.pop(sid)
            assert self.m.is_swapped(sid)
        self.expect_unchanged(self.m.to_snapshot(), lambda: self.m.swap_out([ids[0]]), FailedPrecondition)
        self.expect_unchanged(self.m.to_snapshot(), lambda: self.m.fork(ids[0], ["zz"]), FailedPrecondition)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True))
        before = self.m.to_snapshot()
        can = self.m.can_swap_in(ids)
        try:
            views = self.m.swap_in(ids)
        except (PendingWrite, OutOfBlocks) as exc:
            EVENTS[f"swap_in_{type(exc).__name__}"] += 1
            assert not can
            assert self.m.to_snapshot() == before
            return
        assert can
        EVENTS["swap_in"] += 1
        for v in views:
            assert v.num_tokens == len(self.swapped[v.seq_id])
            self.expected[v.seq_id] = self.swapped.pop(v.seq_id)
        self.expect_unchanged(self.m.to_snapshot(), lambda: self.m.swap_in([ids[0]]), FailedPrecondition)
        self.expect_unchanged(self.m.to_snapshot(), lambda: self.m.swap_in(["nobody"]), UnknownSequence)
        self.expect_unchanged(self.m.to_snapshot(), lambda: self.m.swap_in([]), InvalidRequest)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def free_swapped(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        self.m.free([sid])
        EVENTS["free_swapped"] += 1
        self.forget(sid)
        assert not self.m.has_sequence(sid)

    @rule(pid=st.sampled_from(sorted(base.POOLS)), prefix=st.integers(0, 2), salt=st.sampled_from(base.SALTS),
          evict=st.integers(1, 12), pressure=st.booleans())
    def offload_then_onboard(self, pid, prefix, salt, evict, pressure) -> None:
        """A prompt's prefix computed, freed (cached), evicted off the device (offloaded) —
        by an explicit evict or by allocations under pressure — and asked for again: an
        onboard when the host kept it."""
        before = self.m.host_metrics(pid)
        self.forward(pid, False)
        sid = f"s{self.next_seq + 1}"
        self.allocate(pid, prefix, 24, [1], salt, True)
        self.forward(pid, False)
        if sid in self.expected and sid not in self.pending:
            self.m.free([sid])
            self.forget(sid)
        if pressure:
            for _ in range(3):
                self.allocate(pid, 0, 0, [40 + (self.next_seq % 9)] * 12, None, False)
                self.forward(pid, False)
        else:
            self.m.evict(pid, evict)
        self.forward(pid, False)
        self.allocate(pid, prefix, 24, [1], salt, True)
        after = self.m.host_metrics(pid)
        EVENTS["offload"] += after.offloaded_blocks > before.offloaded_blocks
        EVENTS["onboard"] += after.onboarded_blocks > before.onboarded_blocks
        EVENTS["host_evict"] += after.host_evictions > before.host_evictions

    @invariant()
    def host_ref_counts(self) -> None:
        snap = self.m.to_snapshot()
        for pool in snap["pools"]:
            host = pool["host"]
            holders = [0] * host["num_blocks"]
            for rec in host["swapped"]:
                for h in set(rec[1]):
                    holders[h] += 1
                assert rec[0] in self.swapped
            for _, h in host["holds"]:
                holders[h] += 1
            assert host["ref_cnt"] == holders
            assert not any(holders[b] for b in host["free_list"] + host["cached_list"])
        assert sorted(self.swapped) == sorted(self.m.swapped_ids())


def run_tier_machine(max_examples: int, steps: int, derandomize: bool) -> None:
    EVENTS.clear()
    base.EVENTS.clear()
    run_state_machine_as_test(
        TierMachine,
        settings=settings(
            max_examples=max_examples, stateful_step_count=steps, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            derandomize=derandomize, database=None,
        ),
    )
    print(dict(EVENTS), dict(base.EVENTS))
    for event in ("swap_out", "swap_in", "free_swapped", "offload", "onboard", "host_evict",
                  "swap_in_PendingWrite", "swap_out_OutOfBlocks"):
        assert EVENTS[event] > 0, f"the tier machine never exercised {event}: {dict(EVENTS)}"
    for event in ("cow", "fork", "commit", "step_failed", "prefix_hit"):
        assert base.EVENTS[event] > 0, f"the tier machine never exercised {event}: {dict(base.EVENTS)}"


def test_two_tier_core_state_machine() -> None:
    run_tier_machine(max_examples=25, steps=40, derandomize=True)  # --slow: 600 x 60, random seeds


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_two_tier_core_state_machine_long() -> None:
    run_tier_machine(max_examples=600, steps=60, derandomize=False)
