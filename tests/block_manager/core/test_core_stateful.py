"""Hypothesis state machine over the whole core, checked against a shadow KV memory.

The shadow plays the compute node: it owns a token "memory" per pool (slot → token),
applies pending copy ops in op_id order before every step that writes (exactly the
contract nodes follow), writes each new token into the slot the core returned, and acks
what it applied. After every step each live sequence's tokens, read back through its
current block table, must equal what the sequence was given — which checks prefix hits
(cached blocks hold exactly the prompt's prefix), copy-on-write, eviction/reuse and
defrag moves end to end. Failed calls must leave `to_snapshot()` unchanged.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from block_manager.core import (
    AppendFailure,
    AppendRequest,
    AppendResult,
    BlockManager,
    CoreError,
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    SequenceExists,
    UnknownSequence,
)

POOLS = {"p": (40, 4), "q": (24, 2)}  # pool id → (num_blocks, block_size)
PREFIXES = [list(range(100, 124)), list(range(200, 224)), [7] * 24]
SALTS = [None, None, "tenant-a"]
has_live = precondition(lambda self: bool(self.expected))
EVENTS: Counter[str] = Counter()  # what the runs exercised; the test checks coverage


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(watermark=0.1)
        for pid, (n, bs) in POOLS.items():
            self.m.add_pool(pid, n, bs)
        self.expected: dict[str, list[int]] = {}  # live seq → its tokens
        self.pool_of: dict[str, str] = {}
        self.mem: dict[str, dict[int, int]] = {pid: {} for pid in POOLS}
        self.applied: dict[str, int] = {pid: 0 for pid in POOLS}
        self.next_seq = 0
        self.next_synthetic = -1

    # ---- helpers: the shadow node ---------------------------------------------------
    def new_id(self) -> str:
        self.next_seq += 1
        return f"s{self.next_seq}"

    def synthetic(self, n: int) -> list[int]:
        out = list(range(self.next_synthetic, self.next_synthetic - n, -1))
        self.next_synthetic -= n
        return out

    def apply_pending(self, pid: str) -> None:
        bs = POOLS[pid][1]
        mem = self.mem[pid]
        for op in self.m.pending_copy_ops(pid, self.applied[pid]):
            for off in range(bs):
                src, dst = op.src * bs + off, op.dst * bs + off
                if src in mem:
                    mem[dst] = mem[src]
                else:
                    mem.pop(dst, None)
            self.applied[pid] = op.op_id

    def write(self, pid: str, slots: tuple[int, ...], tokens: list[int]) -> None:
        assert len(slots) == len(tokens)
        mem = self.mem[pid]
        for s, t in zip(slots, tokens):
            mem[s] = t

    def expect_unchanged(self, before: dict, call, *errors: type[CoreError]) -> None:
        with pytest.raises(errors):
            call()
        assert self.m.to_snapshot() == before

    def live(self, data, pid: str | None = None) -> str | None:
        ids = sorted(s for s in self.expected if pid is None or self.pool_of[s] == pid)
        return data.draw(st.sampled_from(ids)) if ids else None

    # ---- rules ----------------------------------------------------------------------
    @rule(
        pid=st.sampled_from(sorted(POOLS)),
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.one_of(st.integers(8, 24), st.integers(0, 24)),
        tail=st.lists(st.integers(0, 50), max_size=6),
        salt=st.sampled_from(SALTS),
        with_tokens=st.booleans(),
    )
    def allocate(self, pid, prefix, prefix_len, tail, salt, with_tokens) -> None:
        tokens = PREFIXES[prefix][:prefix_len] + tail
        if not tokens:
            before = self.m.to_snapshot()
            self.expect_unchanged(before, lambda: self.m.allocate("x", pid, []), InvalidRequest)
            return
        sid = self.new_id()
        before = self.m.to_snapshot()
        can = self.m.can_allocate(pid, len(tokens))
        try:
            if with_tokens:
                r = self.m.allocate(sid, pid, tokens, salt=salt)
            else:
                r = self.m.allocate(sid, pid, num_tokens=len(tokens), salt=salt)
                tokens = self.synthetic(len(tokens))
        except OutOfBlocks:
            EVENTS["allocate_out_of_blocks"] += 1
            assert not can
            assert self.m.to_snapshot() == before
            return
        EVENTS["allocate"] += 1
        EVENTS["prefix_hit"] += r.num_cached_tokens > 0
        bs = POOLS[pid][1]
        assert r.num_cached_tokens % bs == 0 and r.num_cached_tokens <= len(tokens) - 1
        if not with_tokens:
            assert r.num_cached_tokens == 0
        assert len(r.slot_mapping) == len(tokens) - r.num_cached_tokens
        self.apply_pending(pid)
        # The cached prefix must already hold exactly these tokens.
        for pos in range(r.num_cached_tokens):
            slot = r.block_table[pos // bs] * bs + pos % bs
            assert self.mem[pid].get(slot) == tokens[pos], "prefix hit on wrong content"
        self.write(pid, r.slot_mapping, tokens[r.num_cached_tokens :])
        self.expected[sid] = list(tokens)
        self.pool_of[sid] = pid

    @rule(
        pid=st.sampled_from(sorted(POOLS)),
        prefix=st.integers(0, 1),
        extra_blocks=st.integers(0, 3),
        salt=st.sampled_from(SALTS),
    )
    def allocate_shared_prefix(self, pid, prefix, extra_blocks, salt) -> None:
        """A prompt that is a whole-block prefix of a shared one plus a little: the case
        where cache hits are likely."""
        bs = POOLS[pid][1]
        self.allocate(pid, prefix, bs * (2 + extra_blocks), [1], salt, True)

    @has_live
    @rule(data=st.data(), decode_only=st.booleans())
    def append(self, data, decode_only) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(self.expected)), min_size=1, max_size=6, unique=True)
        )
        requests = []
        new_tokens: dict[str, list[int]] = {}
        for sid in chosen:
            n = 1 if decode_only else data.draw(st.integers(1, 6))
            if data.draw(st.booleans()):
                toks = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
                requests.append(AppendRequest(sid, n, tuple(toks)))
            else:
                toks = self.synthetic(n)
                requests.append(AppendRequest(sid, n))
            new_tokens[sid] = toks
        bad = data.draw(st.sampled_from([None, "unknown", "zero", "mismatch", "dup"]))
        if bad == "unknown":
            requests.append(AppendRequest("nobody", 1))
        elif bad == "zero" and chosen:
            requests.append(AppendRequest(chosen[0], 0))
        elif bad == "mismatch":
            requests.append(AppendRequest(chosen[0] if chosen else "nobody", 2, (1,)))
        elif bad == "dup" and chosen:
            requests.append(AppendRequest(chosen[0], 1))
        views_before = {sid: self.m.get_sequence(sid) for sid in chosen}
        can = {sid: self.m.can_append(sid, len(new_tokens[sid])) for sid in chosen}
        results = self.m.append_slots(requests)
        assert len(results) == len(requests)
        for req, res in zip(requests[len(chosen) :], results[len(chosen) :]):  # noqa: B007 (the seed hashes this source)
            assert isinstance(res, AppendFailure) and isinstance(
                res.error, (UnknownSequence, InvalidRequest)
            )
        pools_touched = set()
        for sid, res in zip(chosen, results):
            if isinstance(res, AppendFailure):
                EVENTS["append_out_of_blocks"] += 1
                assert isinstance(res.error, OutOfBlocks)
                assert self.m.get_sequence(sid) == views_before[sid]
                continue
            assert isinstance(res, AppendResult)
            EVENTS["append"] += 1
            EVENTS["cow"] += bool(res.copy_ops)
            EVENTS["append_new_block"] += bool(res.new_block_ids)
            before = views_before[sid]
            assert res.num_tokens == before.num_tokens + len(new_tokens[sid])
            assert (res.version > before.version) == (
                bool(res.new_block_ids) or bool(res.copy_ops)
            )
            pools_touched.add(self.pool_of[sid])
        # `can_append` is exact for a sequence that comes first in its pool's batch.
        first = chosen[0] if chosen else None
        if first is not None:
            assert can[first] == isinstance(results[0], AppendResult)
        for pid in sorted(pools_touched):
            self.apply_pending(pid)
        for sid, res in zip(chosen, results):
            if isinstance(res, AppendResult):
                self.write(self.pool_of[sid], res.slot_mapping, new_tokens[sid])
                self.expected[sid].extend(new_tokens[sid])

    @has_live
    @rule(data=st.data(), num_children=st.integers(1, 3))
    def fork(self, data, num_children) -> None:
        parent = self.live(data)
        assert parent is not None
        children = [self.new_id() for _ in range(num_children)]
        views = self.m.fork(parent, children)
        EVENTS["fork"] += 1
        assert [v.block_table for v in views] == [self.m.get_sequence(parent).block_table] * num_children
        for c in children:
            self.expected[c] = list(self.expected[parent])
            self.pool_of[c] = self.pool_of[parent]
        before = self.m.to_snapshot()
        self.expect_unchanged(before, lambda: self.m.fork(parent, [children[0]]), SequenceExists)

    @has_live
    @rule(data=st.data(), everything=st.sampled_from([False] * 7 + [True]))
    def free(self, data, everything) -> None:
        if everything:
            self.free_everything()
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.expected)), min_size=1, max_size=4, unique=True))
        before = self.m.to_snapshot()
        self.expect_unchanged(before, lambda: self.m.free([*ids, "nobody"]), UnknownSequence)
        self.expect_unchanged(before, lambda: self.m.free([*ids, ids[0]]), InvalidRequest)
        self.m.free(ids)
        EVENTS["free"] += 1
        for sid in ids:
            del self.expected[sid]
            del self.pool_of[sid]

    @has_live
    @rule(
        data=st.data(),
        kind=st.sampled_from(["compaction", "contiguity"]),
        max_moves=st.sampled_from([None, 1, 3]),
    )
    def free_some_then_plan(self, data, kind, max_moves) -> None:
        """Frees punch holes; planning right after is when defrag has work to do."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.expected)), max_size=3, unique=True))
        self.m.free(ids)
        for sid in ids:
            del self.expected[sid]
            del self.pool_of[sid]
        for pid in sorted(POOLS):
            self.plan_defrag(pid, kind, max_moves)

    @rule(
        action=st.sampled_from(["evict", "evict", "snapshot", "snapshot", "reset"]),
        pid=st.sampled_from(sorted(POOLS)),
        n=st.integers(0, 5),
        all_pools=st.booleans(),
    )
    def housekeeping(self, action, pid, n, all_pools) -> None:
        if action == "evict":
            cached = self.m.metrics(pid).num_cached_blocks
            assert self.m.evict(pid, n) == min(n, cached)
            EVENTS["evict"] += 1
        elif action == "snapshot":
            snap = self.m.to_snapshot()
            self.m = BlockManager.from_snapshot(json.loads(json.dumps(snap)))
            assert self.m.to_snapshot() == snap
        else:
            self.m.reset_prefix_cache(None if all_pools else pid)
            pools = list(POOLS) if all_pools else [pid]
            assert all(self.m.metrics(p).num_cached_blocks == 0 for p in pools)

    @rule(
        action=st.sampled_from(["plan", "plan", "ack", "commit", "commit", "abort"]),
        pid=st.sampled_from(sorted(POOLS)),
        kind=st.sampled_from(["compaction", "contiguity"]),
        max_moves=st.sampled_from([None, 1, 3]),
    )
    def defrag(self, action, pid, kind, max_moves) -> None:
        if action in ("commit", "abort"):
            # Act on whichever pool has a plan (prefer `pid`).
            pid = next((p for p in [pid, *sorted(POOLS)] if self.m.get_defrag_plan(p)), pid)
        plan = self.m.get_defrag_plan(pid)
        if action == "plan":
            self.plan_defrag(pid, kind, max_moves)
        elif action == "ack":
            self.node_applies_and_acks(pid)
        elif plan is not None and action == "commit":
            self.commit_defrag(pid, plan)
        elif plan is not None:
            self.m.abort_defrag(plan.plan_id)
            EVENTS["abort"] += 1
            assert self.m.metrics(pid).num_reserved_blocks == 0

    def plan_defrag(self, pid, kind, max_moves) -> None:
        if self.m.get_defrag_plan(pid) is not None:
            before = self.m.to_snapshot()
            self.expect_unchanged(before, lambda: self.m.plan_defrag(pid, kind), FailedPrecondition)
            return
        plan = self.m.plan_defrag(pid, kind, max_moves)
        if plan is not None:
            EVENTS[f"plan_{kind}"] += 1
            assert plan.moves and (max_moves is None or len(plan.moves) <= max_moves)
            assert self.m.pending_copy_ops(pid)[-len(plan.moves) :] == list(plan.moves)

    def node_applies_and_acks(self, pid) -> None:
        self.apply_pending(pid)
        if self.applied[pid]:
            self.m.ack_copy_ops(pid, self.applied[pid])
        assert self.m.pending_copy_ops(pid) == []

    def commit_defrag(self, pid, plan) -> None:
        pending = self.m.pending_copy_ops(pid)
        if pending and pending[0].op_id <= plan.moves[-1].op_id:
            before = self.m.to_snapshot()
            self.expect_unchanged(before, lambda: self.m.commit_defrag(plan.plan_id), FailedPrecondition)
            self.node_applies_and_acks(pid)
        hwm_before = self.m.metrics(pid).high_water_mark
        changed = self.m.commit_defrag(plan.plan_id)
        EVENTS["commit"] += 1
        assert len(set(changed)) == len(changed)
        if plan.kind == "compaction":
            assert self.m.metrics(pid).high_water_mark <= hwm_before

    def free_everything(self) -> None:
        for pid in POOLS:
            plan = self.m.get_defrag_plan(pid)
            if plan is not None:
                self.m.abort_defrag(plan.plan_id)
        self.m.free(sorted(self.expected))
        EVENTS["free_everything"] += 1
        self.expected.clear()
        self.pool_of.clear()
        for pid, (n, _) in POOLS.items():
            met = self.m.metrics(pid)
            assert met.num_used_blocks == 0 and met.num_reserved_blocks == 0
            assert met.num_free_blocks + met.num_cached_blocks == n

    # ---- invariants -----------------------------------------------------------------
    @invariant()
    def healthy(self) -> None:
        assert self.m.fsck() == []

    @invariant()
    def counts_and_ref_counts(self) -> None:
        snap = self.m.to_snapshot()
        for pool in snap["pools"]:
            pid = pool["pool_id"]
            n, bs = POOLS[pid]
            met = self.m.metrics(pid)
            assert met.num_free_blocks + met.num_used_blocks + met.num_cached_blocks + \
                met.num_reserved_blocks == n
            holders = [0] * n
            for seq in self.m.sequences(pid):
                assert len(seq.block_table) == -(-seq.num_tokens // bs)
                for b in seq.block_table:
                    holders[b] += 1
            assert pool["ref_cnt"] == holders
            queued = set(pool["free_list"]) | set(pool["cached_list"])
            assert not any(holders[b] for b in queued)

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        for sid, tokens in self.expected.items():
            view = self.m.get_sequence(sid)
            pid = self.pool_of[sid]
            bs = POOLS[pid][1]
            assert view.num_tokens == len(tokens)
            mem = self.mem[pid]
            got = [mem.get(view.block_table[i // bs] * bs + i % bs) for i in range(len(tokens))]
            assert got == tokens, f"{sid} reads back wrong tokens"


def run_machine(max_examples: int, steps: int, derandomize: bool) -> None:
    EVENTS.clear()
    run_state_machine_as_test(
        CoreMachine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            derandomize=derandomize,
            database=None,
        ),
    )
    print(dict(EVENTS))
    # The generator must keep reaching the interesting paths, or the test proves little.
    for event in ("prefix_hit", "cow", "append_new_block", "allocate_out_of_blocks", "fork",
                  "plan_compaction", "plan_contiguity", "commit", "abort"):
        assert EVENTS[event] > 0, f"the state machine never exercised {event}: {dict(EVENTS)}"


def test_core_state_machine() -> None:
    """CI size: ~6000 steps, a fixed seed so the run (and its coverage) is reproducible."""
    run_machine(max_examples=150, steps=40, derandomize=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_core_state_machine_long() -> None:
    """`--slow`: random seeds, 5x the examples, longer runs."""
    run_machine(max_examples=750, steps=60, derandomize=False)
