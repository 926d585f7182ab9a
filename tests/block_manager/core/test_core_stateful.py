"""Hypothesis state machine over the whole core, driven the way the step protocol drives it.

The machine plays both the scheduler and a compute node. The scheduler calls the core
(allocate, append, fork, free, defrag plans) and remembers, per sequence, which tokens it
must write in the open step. `forward` is one step end to end: the core closes the pool's
step, the *node* applies the step exactly as a compute node does — the step's copy ops first,
then its table deltas to its own cached tables (never reading the core's tables), then it
writes every pending token at the tail of the sequence's node-side table — and the scheduler
settles the step as complete (or, sometimes, as failed: the node did nothing, and the core
must drop what that step wrote).

Checked after every rule, for every live sequence that has no pending writes: its tokens,
read back through the *node's* table from the node's memory, equal what the sequence was
given, and after every Forward the node's tables equal the core's. That covers prefix hits
(cached blocks hold exactly the prompt's prefix), copy-on-write, eviction/reuse, defrag moves
(only written blocks move), failure handling and the deltas themselves. Failed calls leave
`to_snapshot()` unchanged.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

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
    PendingWrite,
    SequenceExists,
    StepOutput,
    UnknownSequence,
)
from block_manager.core.errors import LateIdsPending
from block_manager.core.hashing import hash_prefix

POOLS = {"p": (40, 4), "q": (24, 2)}  # pool id → (num_blocks, block_size)
PREFIXES = [list(range(100, 124)), list(range(200, 224)), [7] * 24]
SALTS = [None, None, "tenant-a"]
has_live = precondition(lambda self: bool(self.expected))
EVENTS: Counter[str] = Counter()  # what the runs exercised; the test checks coverage


@dataclass
class ShadowNode:
    """A compute node's view of one pool: its tables (from deltas only) and its memory."""

    block_size: int
    tables: dict[str, list[int]] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)
    mem: dict[int, int] = field(default_factory=dict)
    last_step: int = 0

    def apply(self, out: StepOutput) -> None:
        # Steps arrive in order; after failed (never applied) steps the next one says so.
        assert out.base_step_id <= self.last_step < out.step_id, (out.base_step_id, self.last_step, out.step_id)
        self.last_step = out.step_id
        bs = self.block_size
        for op in out.copy_ops:  # before any write of the step
            for off in range(bs):
                src, dst = op.src * bs + off, op.dst * bs + off
                if src in self.mem:
                    self.mem[dst] = self.mem[src]
                else:
                    self.mem.pop(dst, None)
        for sid in out.dropped_seq_ids:
            self.tables.pop(sid, None)
            self.versions.pop(sid, None)
            self.num_tokens.pop(sid, None)
        for d in out.deltas:
            if d.base_version == 0:
                self.tables[d.seq_id] = list(d.appended)
                self.num_tokens[d.seq_id] = d.num_tokens
            else:
                assert self.versions.get(d.seq_id) == d.base_version, "delta on a table version the node lacks"
                table = self.tables[d.seq_id]
                for pos, block in d.replaced:
                    table[pos] = block
                table.extend(d.appended)
            self.versions[d.seq_id] = d.version

    def write_tail(self, sid: str, tokens: list[int]) -> None:
        """Write at positions [num_tokens, num_tokens + n) of the node's own table: the
        tail rule a compute node enforces."""
        bs = self.block_size
        table = self.tables[sid]
        start = self.num_tokens[sid]
        assert -(-(start + len(tokens)) // bs) <= len(table), "write beyond the node's table"
        for i, t in enumerate(tokens):
            pos = start + i
            self.mem[table[pos // bs] * bs + pos % bs] = t
        self.num_tokens[sid] = start + len(tokens)

    def read(self, sid: str, n: int) -> list[int | None]:
        bs = self.block_size
        table = self.tables[sid]
        return [self.mem.get(table[i // bs] * bs + i % bs) for i in range(n)]


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(watermark=0.1)
        for pid, (n, bs) in POOLS.items():
            self.m.add_pool(pid, n, bs)
        self.expected: dict[str, list[int]] = {}  # live seq → its tokens
        self.pool_of: dict[str, str] = {}
        self.pending: dict[str, list[int]] = {}   # seq → tokens to write in the open step
        # seq → the real ids of its tokens appended with late ids (test_core_late_ids_stateful.py;
        # always empty here: the hooks below draw nothing, so this machine explores as before)
        self.late: dict[str, list[int]] = {}
        self.salt_of: dict[str, str | None] = {}
        self.nodes = {pid: ShadowNode(bs) for pid, (_, bs) in POOLS.items()}
        self.next_seq = 0
        self.next_synthetic = -1

    # ---- helpers --------------------------------------------------------------------
    def new_id(self) -> str:
        self.next_seq += 1
        return f"s{self.next_seq}"

    def synthetic(self, n: int) -> list[int]:
        out = list(range(self.next_synthetic, self.next_synthetic - n, -1))
        self.next_synthetic -= n
        return out

    def expect_unchanged(self, before: dict, call, *errors: type[CoreError]) -> None:
        with pytest.raises(errors):
            call()
        assert self.m.to_snapshot() == before

    def live(self, data, pid: str | None = None) -> str | None:
        ids = sorted(s for s in self.expected if pid is None or self.pool_of[s] == pid)
        return data.draw(st.sampled_from(ids)) if ids else None

    def forget(self, sid: str) -> None:
        del self.expected[sid]
        del self.pool_of[sid]
        self.pending.pop(sid, None)
        self.late.pop(sid, None)

    def appendable(self) -> list[str]:
        """The live sequences an append may name (not those awaiting late ids)."""
        return sorted(s for s in self.expected if s not in self.late)

    # ---- rules: the scheduler -------------------------------------------------------
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
        # A prefix hit's blocks are written or written earlier in this same step; either way
        # the node reads them after this step's writes.
        self.expected[sid] = list(tokens)
        self.pool_of[sid] = pid
        self.salt_of[sid] = salt
        self.pending[sid] = list(tokens[r.num_cached_tokens :])

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
        ready = self.appendable()
        if not ready:
            return
        chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=6, unique=True))
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
        elif bad == "zero":
            requests.append(AppendRequest(chosen[0], 0))
        elif bad == "mismatch":
            requests.append(AppendRequest(chosen[0], 2, (1,)))
        elif bad == "dup":
            requests.append(AppendRequest(chosen[0], 1))
        views_before = {sid: self.m.get_sequence(sid) for sid in chosen}
        can = {sid: self.m.can_append(sid, len(new_tokens[sid])) for sid in chosen}
        results = self.m.append_slots(requests)
        assert len(results) == len(requests)
        for res in results[len(chosen) :]:
            assert isinstance(res, AppendFailure) and isinstance(res.error, (UnknownSequence, InvalidRequest))
        for sid, res in zip(chosen, results):
            if isinstance(res, AppendFailure):
                assert isinstance(res.error, (OutOfBlocks, PendingWrite))
                EVENTS["pending_write" if isinstance(res.error, PendingWrite) else "append_out_of_blocks"] += 1
                assert self.m.get_sequence(sid) == views_before[sid]
                continue
            assert isinstance(res, AppendResult)
            EVENTS["append"] += 1
            EVENTS["cow"] += bool(res.copy_ops)
            EVENTS["append_new_block"] += bool(res.new_block_ids)
            before = views_before[sid]
            assert res.num_tokens == before.num_tokens + len(new_tokens[sid])
            assert (res.version > before.version) == (bool(res.new_block_ids) or bool(res.copy_ops))
            self.expected[sid].extend(new_tokens[sid])
            self.pending.setdefault(sid, []).extend(new_tokens[sid])
        # `can_append` is exact for the first sequence of the batch.
        assert can[chosen[0]] == isinstance(results[0], AppendResult)

    @has_live
    @rule(data=st.data(), num_children=st.integers(1, 3))
    def fork(self, data, num_children) -> None:
        parent = self.live(data)
        assert parent is not None
        children = [self.new_id() for _ in range(num_children)]
        if parent in self.late:   # the children would inherit placeholders
            before = self.m.to_snapshot()
            self.expect_unchanged(before, lambda: self.m.fork(parent, children), LateIdsPending)
            EVENTS["late_refused"] += 1
            return
        views = self.m.fork(parent, children)
        EVENTS["fork"] += 1
        assert [v.block_table for v in views] == [self.m.get_sequence(parent).block_table] * num_children
        for c in children:
            self.expected[c] = list(self.expected[parent])
            self.pool_of[c] = self.pool_of[parent]
            self.salt_of[c] = self.salt_of[parent]
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
        if any(s in self.pending for s in ids):
            # Its writes (which forks and prefix hits may share) would never run.
            self.expect_unchanged(before, lambda: self.m.free(ids), PendingWrite)
            EVENTS["free_pending"] += 1
            ids = [s for s in ids if s not in self.pending]
            if not ids:
                return
        self.expect_unchanged(before, lambda: self.m.free([*ids, "nobody"]), UnknownSequence)
        self.expect_unchanged(before, lambda: self.m.free([*ids, ids[0]]), InvalidRequest)
        self.m.free(ids)
        EVENTS["free"] += 1
        for sid in ids:
            self.forget(sid)

    @has_live
    @rule(
        data=st.data(),
        kind=st.sampled_from(["compaction", "contiguity"]),
        max_moves=st.sampled_from([None, 1, 3]),
    )
    def free_some_then_plan(self, data, kind, max_moves) -> None:
        """Frees punch holes; planning right after is when defrag has work to do."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.expected)), max_size=3, unique=True))
        ids = [s for s in ids if s not in self.pending]
        self.m.free(ids)
        for sid in ids:
            self.forget(sid)
        for pid in sorted(POOLS):
            # only written blocks move: run the pool's Forward first so the fresh writes count
            self.forward(pid, False)
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
        action=st.sampled_from(["plan", "plan", "plan", "abort"]),
        pid=st.sampled_from(sorted(POOLS)),
        kind=st.sampled_from(["compaction", "contiguity"]),
        max_moves=st.sampled_from([None, 1, 3]),
    )
    def defrag(self, action, pid, kind, max_moves) -> None:
        if action == "plan":
            self.plan_defrag(pid, kind, max_moves)
            return
        pid = next((p for p in [pid, *sorted(POOLS)] if self.m.get_defrag_plan(p)), pid)
        plan = self.m.get_defrag_plan(pid)
        if plan is not None:
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

    # ---- rules: one step end to end -------------------------------------------------
    @rule(pid=st.sampled_from(sorted(POOLS)), fail=st.sampled_from([False] * 9 + [True]))
    def forward(self, pid, fail) -> None:
        out = self.m.close_step(pid)
        if out is None:
            assert not any(self.pool_of[s] == pid for s in self.pending)
            return
        writers = sorted(s for s in self.pending if self.pool_of[s] == pid)
        self.step_closed(pid)
        if fail:
            # The Forward never ran: nothing reached the node; the core drops what it wrote.
            result = self.m.settle_steps(pid, out.step_id - 1, failed_from=out.step_id)
            EVENTS["step_failed"] += 1
            assert set(writers) <= set(result.dropped_seq_ids)
            for sid in result.dropped_seq_ids:
                self.forget(sid)
            return
        node = self.nodes[pid]
        node.apply(out)
        for sid in writers:
            node.write_tail(sid, self.pending.pop(sid))
        result = self.m.settle_steps(pid, out.step_id)
        self.step_settled(pid)
        EVENTS["commit"] += len(result.committed_plan_ids)
        assert result.dropped_seq_ids == ()
        if not result.committed_plan_ids:
            for v in self.m.sequences(pid):  # the deltas rebuilt exactly the core's tables
                assert tuple(node.tables[v.seq_id]) == v.block_table
                assert node.versions[v.seq_id] == v.version

    def step_closed(self, pid: str) -> None:
        """Hook: the pool's step is closed, its Forward not reported yet."""

    def step_settled(self, pid: str) -> None:
        """Hook: the pool's step was reported complete."""

    def free_everything(self) -> None:
        for pid in POOLS:
            self.forward(pid, False)  # a scheduler frees after the writes ran
            plan = self.m.get_defrag_plan(pid)
            if plan is not None:
                self.m.abort_defrag(plan.plan_id)
        self.m.free(sorted(self.expected))
        EVENTS["free_everything"] += 1
        for sid in sorted(self.expected):
            self.forget(sid)
        for pid, (n, _) in POOLS.items():
            met = self.m.metrics(pid)
            assert met.num_used_blocks == 0 and met.num_reserved_blocks == 0
            assert met.num_free_blocks + met.num_cached_blocks == n

    # ---- invariants -----------------------------------------------------------------
    @invariant()
    def healthy(self) -> None:
        assert self.m.fsck() == []

    @invariant()
    def hashes_follow_the_real_tokens(self) -> None:
        """Every hashing sequence awaiting no late ids hashes exactly its tokens' full blocks,
        every sequence, every step (a block hashed on wrong content would show here)."""
        for sid, tokens in self.expected.items():
            seq = self.m._seqs[sid]
            if seq.hashing and sid not in self.late:
                bs = POOLS[self.pool_of[sid]][1]
                assert seq.block_hashes == hash_prefix(tokens, bs, self.salt_of[sid]), sid

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
    def every_sequence_reads_back_its_tokens_on_the_node(self) -> None:
        """Every live sequence whose writes all ran (and that the node knows: one created
        in the open step is announced by the next Forward) reads back its tokens through
        the node's own table — every sequence, every step."""
        for sid, tokens in self.expected.items():
            node = self.nodes[self.pool_of[sid]]
            if sid in self.pending or sid not in node.tables:
                continue
            assert self.m.get_sequence(sid).num_tokens == len(tokens)
            assert node.read(sid, len(tokens)) == tokens, f"{sid} reads back wrong tokens on the node"


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
                  "plan_compaction", "plan_contiguity", "commit", "abort", "pending_write", "step_failed"):
        assert EVENTS[event] > 0, f"the state machine never exercised {event}: {dict(EVENTS)}"


def test_core_state_machine() -> None:
    """CI size: ~4000 steps, a fixed seed so the run (and its coverage) is reproducible."""
    run_machine(max_examples=100, steps=40, derandomize=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_core_state_machine_long() -> None:
    """`--slow`: random seeds, 5x the examples, longer runs."""
    run_machine(max_examples=750, steps=60, derandomize=False)
