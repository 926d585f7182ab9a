"""Scheduler-step batching: one `Step` RPC per scheduler step, none for in-block decode.

A scheduler step is: report the previous Forwards, free finished sequences, admit new ones,
fork, append the step's new tokens. `StepBatch` collects those into ONE `Step` request; the
answer carries, per pool, the `PoolStep` to pass to that pool's node in its Forward. In steady
decode most appends need no RPC at all, because they land inside the sequence's last block and
the client can answer them itself.

The client mirrors the table of every sequence it drives, from the steps' deltas (the same
deltas its nodes apply), so it knows each sequence's last block, length and version.

Deferred appends (the correctness argument)
-------------------------------------------
An append of `n` tokens is answered locally iff

  * the last block is exclusively owned (`tail_exclusive`): it came from an allocation (a
    partial last block is never a prefix-cache hit: hits are full blocks only) or from a
    server append (which copy-on-writes a shared partial block), and no Fork touched the
    sequence since (after a Fork, parent and children all go to the server, which does CoW);
  * it stays strictly inside that block and does not fill it (`0 < num_tokens % bs` and
    `num_tokens % bs + n < bs`).

Nobody else can touch that block then: it is partial both in truth and in the server's view, so
it is never hashed, never shared by a prefix hit, never moved by defrag (only full blocks move)
and never evicted (ref_cnt 1); only a Fork could share it, and forks go through this client
(one scheduler drives a pool: the server's scheduler lease). The table does not change, so the
node's table is current; the Forward names the sequence and its new length, and the node writes
at the tail of its own record of the sequence.

The deferred tokens are reported to the server as the head of the sequence's next server append
(`num_new_tokens = deferred + new`), or, before a Fork of the sequence, as an already-written
report (the children inherit the true length). A block is never *filled* by a deferred append,
so the server always knows every full block in time to hash it for prefix caching, and a Free of
a sequence with deferred tokens loses nothing (a partial block is never cached). If the block
manager crashes before the report, its recovered state simply lacks the deferred tokens and the
next report re-appends them into the same partial block at the same slots.

Late ids (async scheduling)
---------------------------
A scheduler that plans step N+1 while step N runs appends the token N samples before it knows
its id: `append(..., num_late=k)`, the last k ids placeholders. Once it knows them it gives
them to `SequenceTracker.resolve_late`, whichever way the append went. Answered in place (in
the block), the ids replace the placeholders among the deferred ids, which reach the server
with a later append; until then no append of the sequence may go to the server. Sent to the
server (it starts or fills a block), the append carries `num_late`: the server hashes nothing
that holds placeholders, and every Step built once the ids are known carries them (the
request's late section, applied before every other section that may touch the sequence) until
one is answered.

When a whole Step RPC fails after the client's retries (its outcome is unknown), the client
stops answering locally for every sequence the request named (they go to the server from then
on); `resend()` repeats the request under its request id, which the server applies at most once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from block_manager.client import wire
from block_manager.client.errors import InvalidArgumentError, StepStateError
from block_manager.client.types import Admission, ItemFailure, PoolStepInfo, SeqSlots, StepSettled
from block_manager.core.types import PoolId, SeqId, TableDelta
from pagedkv.v1 import block_manager_pb2 as pb


@dataclass(slots=True)
class TrackedSequence:
    """The client's mirror of one sequence it drives (table from the steps' deltas)."""

    seq_id: SeqId
    pool_id: PoolId
    block_size: int
    num_tokens: int            # true length, deferred tokens included
    tail_exclusive: bool
    block_table: list[int] = field(default_factory=list)
    version: int = 0
    num_deferred: int = 0
    deferred_token_ids: list[int] | None = field(default_factory=list)  # None: some came without ids
    late_at: list[int] = field(default_factory=list)   # positions in deferred_token_ids awaiting ids

    def can_append_locally(self, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` stay strictly inside the exclusive, partial last block."""
        offset = self.num_tokens % self.block_size
        return (
            self.tail_exclusive
            and offset != 0
            and offset + num_new_tokens < self.block_size
            and len(self.block_table) * self.block_size >= self.num_tokens
        )

    def append_locally(self, num_new_tokens: int, token_ids: Sequence[int] | None, num_late: int = 0) -> None:
        """Answer an in-block append here (deferred: reported to the server later); its last
        `num_late` ids are placeholders until `SequenceTracker.resolve_late`."""
        self.num_tokens += num_new_tokens
        self.num_deferred += num_new_tokens
        if token_ids is None or self.deferred_token_ids is None:
            self.deferred_token_ids = None
            self.late_at = []
        else:
            self.deferred_token_ids.extend(token_ids)
            if num_late:
                end = len(self.deferred_token_ids)
                self.late_at.extend(range(end - num_late, end))

    def server_request(self, num_new_tokens: int, token_ids: Sequence[int] | None) -> tuple[int, list[int] | None]:
        """The deferred tokens followed by the step's new ones, as one append item."""
        if self.late_at:
            raise InvalidArgumentError(
                f"sequence {self.seq_id!r}: {len(self.late_at)} deferred token ids are still to come "
                "(resolve_late them before the sequence's next append to the server)", method="Step")
        ids: list[int] | None = None
        if token_ids is not None and self.deferred_token_ids is not None:
            ids = [*self.deferred_token_ids, *token_ids]
        return self.num_deferred + num_new_tokens, ids

    def apply_delta(self, d: TableDelta) -> None:
        """Follow the table change a step handed out."""
        if d.base_version == 0:
            self.block_table = list(d.appended)
        else:
            for pos, block in d.replaced:
                self.block_table[pos] = block
            self.block_table.extend(d.appended)
        self.version = d.version

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Slots of positions `start … end-1` (what a worker writing them needs)."""
        bs = self.block_size
        table = self.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


class SequenceTracker:
    """The client's view of the sequences it drives through steps (see module docstring).

    Pools whose block size is unknown are not tracked: their appends always go to the
    server, which is always correct, just not free.
    """

    def __init__(self, block_sizes: Mapping[str, int] | None = None) -> None:
        self.block_sizes: dict[str, int] = dict(block_sizes or {})
        self._seqs: dict[SeqId, TrackedSequence] = {}
        # late ids to send (module docstring), kept apart from the mirrors: a sequence whose
        # Step outcome was unknown is forgotten here, but its late ids are still owed
        self.late_ids: dict[SeqId, list[int]] = {}

    def resolve_late(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """The ids of a sequence's tokens appended with `num_late` (module docstring): into its
        deferred ids if the append was answered here, else sent with the next Step."""
        t = self._seqs.get(cast(SeqId, seq_id))   # a SeqId is a str: no call per token
        if t is not None and t.late_at:
            late_at, ids = t.late_at, t.deferred_token_ids
            if len(token_ids) != len(late_at):
                raise InvalidArgumentError(
                    f"sequence {seq_id!r}: {len(token_ids)} ids for {len(late_at)} deferred placeholders",
                    method="Step")
            if ids is not None:
                for pos, token in zip(late_at, token_ids):
                    ids[pos] = token
            late_at.clear()
            return
        self.late_ids.setdefault(SeqId(seq_id), []).extend(token_ids)

    def __len__(self) -> int:
        return len(self._seqs)

    def set_block_size(self, pool_id: str, block_size: int) -> None:
        """Track sequences of `pool_id` (whose block size is now known)."""
        self.block_sizes[pool_id] = block_size

    def get(self, seq_id: str) -> TrackedSequence | None:
        """The mirror of a sequence, or None when not tracked."""
        return self._seqs.get(SeqId(seq_id))

    def forget(self, seq_id: str) -> None:
        """Stop tracking a sequence (freed, dropped, or its outcome unknown)."""
        self._seqs.pop(SeqId(seq_id), None)

    def track(self, seq_id: SeqId, pool_id: PoolId, num_tokens: int, tail_exclusive: bool) -> None:
        """Start mirroring a sequence admitted (or forked) by a step."""
        bs = self.block_sizes.get(pool_id)
        if bs is not None:
            self._seqs[seq_id] = TrackedSequence(seq_id, pool_id, bs, num_tokens, tail_exclusive)

    def reset_pool(self, pool_id: str) -> None:
        """Forget every sequence mirrored on `pool_id` (its step says the pool was reset: it
        changed hands, so nothing mirrored before this step still holds)."""
        for sid in [s for s, t in self._seqs.items() if t.pool_id == pool_id]:
            del self._seqs[sid]
            self.late_ids.pop(sid, None)

    def apply_step(self, step: PoolStepInfo) -> None:
        """Apply a closed step's deltas and drops to the mirrored tables (its reset, if any,
        was applied before the step's own admissions were mirrored: `reset_pool`)."""
        for sid in step.dropped_seq_ids:
            self._seqs.pop(sid, None)
            self.late_ids.pop(sid, None)
        for d in step.deltas:
            t = self._seqs.get(d.seq_id)
            if t is not None:
                if d.base_version not in (0, t.version):
                    self._seqs.pop(d.seq_id)  # out of step with the server: stop answering locally
                else:
                    t.apply_delta(d)


@dataclass(slots=True)
class StepResult:
    """The answer to one scheduler step.

    `steps`: per pool with work, the `PoolStepInfo` to pass to its node (in the Forward that
    writes this step's tokens) and to report back (`client.report`). `appends` says what each
    appended sequence's Forward entry is; `dropped` lists sequences the server dropped (their
    step failed, or the pool changed hands) — their requests must be restarted.
    """

    steps: dict[PoolId, PoolStepInfo] = field(default_factory=dict)
    settled: dict[PoolId, StepSettled] = field(default_factory=dict)
    allocations: dict[SeqId, Admission | ItemFailure] = field(default_factory=dict)
    forks: dict[SeqId, tuple[SeqId, ...] | ItemFailure] = field(default_factory=dict)  # by parent
    appends: dict[SeqId, SeqSlots | ItemFailure] = field(default_factory=dict)
    dropped: set[SeqId] = field(default_factory=set)
    lease_epochs: dict[PoolId, int] = field(default_factory=dict)
    # every pool's (free, usable: free or evictable) blocks after the step; empty when the
    # step was answered without a round trip
    pool_free: dict[PoolId, tuple[int, int]] = field(default_factory=dict)
    # host tier (docs/tiers.md): swap-outs done, and swap-ins done with the tokens each holds
    swapped_out: dict[SeqId, None | ItemFailure] = field(default_factory=dict)
    swapped_in: dict[SeqId, int | ItemFailure] = field(default_factory=dict)
    late_failures: dict[SeqId, ItemFailure] = field(default_factory=dict)   # late ids refused (dropped)
    host_usable: dict[PoolId, int] = field(default_factory=dict)   # host blocks free or evictable
    num_freed: int = 0
    num_rpcs: int = 0

    @property
    def failures(self) -> list[ItemFailure]:
        """Every item of the step that failed (admissions, forks, appends)."""
        items = [*self.allocations.values(), *self.forks.values(), *self.appends.values(),
                 *self.late_failures.values()]
        return [x for x in items if isinstance(x, ItemFailure)]


class StepBatch:
    """Collect one scheduler step, then `commit()` it (sync client) or `await commit()`.

    One `Step` RPC (or none, when every append was answered locally and there is nothing else
    to tell the server). Per-item failures land in the result; a whole-RPC error is raised with
    nothing changed on the server (or an unknown outcome after retries: see the module
    docstring).
    """

    def __init__(self, client: Any, pool_epochs: Mapping[str, int] | None = None) -> None:
        self._client = client
        self._tracker: SequenceTracker = client.tracker
        self._pool_epochs = dict(pool_epochs or {})
        self._free_ids: list[SeqId] = []
        self._allocs: list[tuple[SeqId, PoolId, tuple[int, ...] | None, int | None, str | None, int | None]] = []
        self._forks: list[tuple[SeqId, tuple[SeqId, ...]]] = []
        self._appends: dict[SeqId, tuple[int, tuple[int, ...] | None, int]] = {}
        self._late: list[SeqId] = []   # the sequences whose late ids this step carries
        self._swap_out: list[SeqId] = []
        self._swap_in: list[SeqId] = []
        self._committed = False
        self._unanswered: pb.StepRequest | None = None   # sent, no answer: `resend` may repeat it
        # Placed allocations (`allocate(..., pool_id=None)`): the pools they may go to (None:
        # every live pool) and the new tokens this step may admit (0: no budget).
        self.place_pools: list[str] | None = None
        self.admit_budget = 0
        self.release = False   # set by `client.release()`
        self.flush = False     # set by `client.flush_reports()`: send the reports even alone
        self.force = False     # set by `client.deliver_grants()`: send the step even empty
        self.result = StepResult()

    # ---- collecting -----------------------------------------------------------------
    def free(self, seq_ids: Iterable[str]) -> None:
        """Free sequences (all or nothing; their previous steps' writes must be done)."""
        self._free_ids.extend(SeqId(s) for s in seq_ids)

    def allocate(
        self,
        seq_id: str,
        pool_id: str | None,
        token_ids: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: str | None = None,
        num_compute: int | None = None,
    ) -> None:
        """Admit a prompt (`token_ids` enable prefix caching; or a bare `num_tokens`).
        `num_compute` caps the uncached tokens this step computes (chunked prefill; append
        the rest of the prompt with its token ids in later steps). `pool_id` None: the block
        manager places it (among `place_pools`, within `admit_budget`) and the answer's
        `Admission.pool_id` says where; refused (`OutOfBlocksError`), it simply waits."""
        if (token_ids is None) == (num_tokens is None):
            raise InvalidArgumentError(f"allocation {seq_id!r}: give token_ids or num_tokens", method="Step")
        ids = tuple(token_ids) if token_ids is not None else None
        self._allocs.append((SeqId(seq_id), PoolId(pool_id or ""), ids, num_tokens, salt, num_compute))

    def fork(self, parent: str, child_ids: Sequence[str]) -> None:
        """Children share every block of the parent (copy-on-write on their first write;
        the parent's last write must be reported done before a child appends)."""
        self._forks.append((SeqId(parent), tuple(SeqId(c) for c in child_ids)))

    def swap_out(self, seq_ids: Iterable[str]) -> None:
        """Preempt sequences to their pool's host tier (docs/tiers.md): their tables leave the
        node, their K/V moves to host in the pool's next step. Forks swapped out together share
        host blocks. A failed item (host full) changed nothing: recompute it instead."""
        self._swap_out.extend(SeqId(s) for s in seq_ids)

    def swap_in(self, seq_ids: Iterable[str]) -> None:
        """Resume swapped-out sequences on device (their swap-out's step must be reported)."""
        self._swap_in.extend(SeqId(s) for s in seq_ids)

    def append(self, seq_id: str, token_ids: Sequence[int] | None = None, *, num_new_tokens: int | None = None,
               num_late: int = 0) -> None:
        """Add new tokens to a sequence: `token_ids` (preferred: enables prefix caching of
        the blocks they fill) or a bare `num_new_tokens`. `num_late`: the last ids in
        `token_ids` are placeholders, their real ids come later (`SequenceTracker.resolve_late`;
        module docstring)."""
        sid = SeqId(seq_id)
        if sid in self._appends:
            raise InvalidArgumentError(f"sequence {seq_id!r} appended twice in one step", method="Step")
        ids = tuple(token_ids) if token_ids is not None else None
        n = len(ids) if ids is not None else num_new_tokens
        if n is None or n < 1 or (num_new_tokens is not None and ids is not None and num_new_tokens != len(ids)):
            raise InvalidArgumentError(
                f"sequence {seq_id!r}: need >= 1 new token (token_ids or num_new_tokens)", method="Step"
            )
        if not 0 <= num_late <= n:
            raise InvalidArgumentError(f"sequence {seq_id!r}: {num_late} late ids for {n} new tokens", method="Step")
        self._appends[sid] = (n, ids, num_late if ids is not None else 0)

    # ---- request --------------------------------------------------------------------
    def build(
        self, request_id: str, scheduler_id: str, reports: Mapping[str, tuple[int, int, int]]
    ) -> pb.StepRequest | None:
        """The Step request, or None when the server need not be asked (appends answered
        locally, nothing else to do)."""
        if self._committed:
            raise InvalidArgumentError("step already committed", method="Step")
        self._committed = True
        res, tracker = self.result, self._tracker
        m = pb.StepRequest(request_id=request_id, scheduler_id=scheduler_id)
        if self._pool_epochs:
            m.pool_epochs.update(self._pool_epochs)
        for pool_id, (epoch, done, failed) in reports.items():
            m.reports.add(pool_id=pool_id, epoch=epoch, completed_up_to=done, failed_from=failed)
        # Forget freed sequences first: after a Free whose answer was lost the blocks may already
        # belong to another sequence, so no slot may be computed locally for these again.
        for sid in self._free_ids:
            tracker.forget(sid)
        m.free_seq_ids.extend(self._free_ids)
        freed = set(self._free_ids)
        for sid, late_ids in list(tracker.late_ids.items()):
            if sid in freed:
                del tracker.late_ids[sid]   # a freed sequence needs no ids
                continue
            self._late.append(sid)
            m.late_seq_ids.append(sid)
            m.late_num_tokens.append(len(late_ids))
            m.late_token_ids.extend(late_ids)
        self._build_allocs(m)
        # Parents with deferred tokens report them first: the children inherit the true length.
        flushed: set[SeqId] = set()
        for parent, children in self._forks:
            t = tracker.get(parent)
            if t is not None and t.num_deferred and parent not in flushed:
                flushed.add(parent)
                n, ids = t.server_request(0, ())
                m.written_seq_ids.append(parent)
                m.written_num_tokens.append(n)
                if ids is not None:
                    m.written_token_ids.extend(ids)
            m.fork_parent_ids.append(parent)
            m.fork_num_children.append(len(children))
            m.fork_child_ids.extend(children)
        # A swapped-out sequence's deferred tokens are reported first (its true length goes to host).
        for sid in self._swap_out:
            t = tracker.get(sid)
            if t is not None and t.num_deferred and sid not in flushed:
                flushed.add(sid)
                n, ids = t.server_request(0, ())
                m.written_seq_ids.append(sid)
                m.written_num_tokens.append(n)
                if ids is not None:
                    m.written_token_ids.extend(ids)
            tracker.forget(sid)
        m.swap_out_seq_ids.extend(self._swap_out)
        m.swap_in_seq_ids.extend(self._swap_in)
        if len(m.written_token_ids) not in (0, sum(m.written_num_tokens)):
            del m.written_token_ids[:]  # ids for all or none
        self._pending: list[tuple[SeqId, int]] = []
        deferred = 0
        with_ids = True
        server: list[tuple[SeqId, int, list[int] | None, int]] = []
        # A fork shares the parent's tail: this step's appends to the parent (and children)
        # need the server's copy-on-write.
        forked = {p for p, _ in self._forks} | {c for _, cs in self._forks for c in cs}
        for sid, (n, new_ids, late) in self._appends.items():
            t = tracker.get(sid)
            if t is not None and sid not in forked and t.can_append_locally(n):
                t.append_locally(n, new_ids, late)
                deferred += n
                res.appends[sid] = SeqSlots(sid, n, t.num_tokens, deferred=True)
                continue
            if t is not None and sid not in flushed:
                total, all_ids = t.server_request(n, new_ids)
            else:
                total, all_ids = n, (list(new_ids) if new_ids is not None else None)
            if late and all_ids is not None:
                all_ids[len(all_ids) - late :] = [0] * late   # placeholders on the wire
            with_ids = with_ids and all_ids is not None
            server.append((sid, total, all_ids, late))
            self._pending.append((sid, n))
        any_late = with_ids and any(late for *_, late in server)
        for sid, total, all_ids, late in server:
            m.append_seq_ids.append(sid)
            m.append_num_tokens.append(total)
            if with_ids and all_ids is not None:
                m.append_token_ids.extend(all_ids)
            if any_late:
                m.append_num_late.append(late)
        self._client.stats.deferred_tokens += deferred
        # Reports alone do not justify a round trip: they ride with the next step that needs one.
        # Late ids alone wait too: nothing can touch their sequences before a Step that needs a trip.
        needed = bool(m.free_seq_ids or m.alloc_seq_ids or m.fork_parent_ids or m.append_seq_ids
                      or m.swap_out_seq_ids or m.swap_in_seq_ids)
        if (self.flush and m.reports) or self.force:
            needed = True
        if self.release:
            m.release_leases = True
            return m
        return m if needed else None

    def _build_allocs(self, m: pb.StepRequest) -> None:
        pools: dict[str, int] = {}
        salts: dict[str, int] = {}
        placing = any(not pool_id for _, pool_id, *_ in self._allocs)
        for sid, pool_id, ids, num_tokens, salt, num_compute in self._allocs:
            m.alloc_seq_ids.append(sid)
            m.alloc_pool_index.append(pools.setdefault(pool_id, len(pools)) if pool_id else 0)
            if placing:
                m.alloc_place.append(not pool_id)
            m.alloc_salt_index.append(-1 if salt is None else salts.setdefault(salt, len(salts)))
            if ids is not None:
                m.alloc_num_token_ids.append(len(ids))
                m.alloc_token_ids.extend(ids)
                m.alloc_num_tokens.append(0)
            else:
                m.alloc_num_token_ids.append(0)
                m.alloc_num_tokens.append(int(num_tokens or 0))
            m.alloc_num_compute.append(num_compute or 0)
        m.pool_ids.extend(pools)
        m.salts.extend(salts)
        if placing:
            m.place_pool_ids.extend(self.place_pools or [])
            m.admit_budget = self.admit_budget

    # ---- response -------------------------------------------------------------------
    def apply(self, m: pb.StepResponse) -> StepResult:
        """Adopt the server's answer: the tracker follows the deltas, the result says what
        each item got."""
        res, tracker = self.result, self._tracker
        res.num_rpcs += 1
        res.num_freed = len(self._free_ids)
        res.lease_epochs = {PoolId(p): int(e) for p, e in m.lease_epochs.items()}
        res.pool_free = {PoolId(f.pool_id): (int(f.num_free_blocks), int(f.num_usable_blocks)) for f in m.pool_free}
        errors: dict[tuple[str, int], Any] = {(e.section, e.index): e for e in m.errors}
        for s in m.settled:
            settled = wire.step_settled(s)
            res.settled[settled.pool_id] = settled
            res.dropped.update(settled.dropped_seq_ids)
            for sid in settled.dropped_seq_ids:
                tracker.forget(sid)
        for ps in m.steps:   # a reset drops what was mirrored BEFORE this step, not its admissions
            if ps.reset:
                tracker.reset_pool(ps.pool_id)
        for i, (sid, pool_id, _ids, _n, _salt, _nc) in enumerate(self._allocs):
            err = errors.get(("alloc", i))
            if err is not None:
                res.allocations[sid] = wire.item_failure(sid, err, "Step")
                continue
            if not pool_id:
                pool_id = PoolId(m.alloc_pool_ids[i])   # placed by the block manager
            res.allocations[sid] = Admission(sid, pool_id, m.alloc_num_cached_tokens[i], m.alloc_num_tokens[i])
            tracker.track(sid, pool_id, m.alloc_num_tokens[i], tail_exclusive=True)
        for i, (parent, children) in enumerate(self._forks):
            err = errors.get(("fork", i))
            t = tracker.get(parent)
            if err is not None:
                res.forks[parent] = wire.item_failure(parent, err, "Step")
                if t is not None:
                    tracker.forget(parent)  # its deferred report may or may not have applied
                continue
            res.forks[parent] = children
            if t is not None:
                t.num_deferred, t.deferred_token_ids = 0, []
                t.tail_exclusive = False
                for c in children:
                    tracker.track(c, t.pool_id, t.num_tokens, tail_exclusive=False)
        for i, sid in enumerate(self._late):
            err = errors.get(("late", i))
            tracker.late_ids.pop(sid, None)   # sent: answered, or refused (its sequence is gone or out of step)
            if err is not None:   # the mirror stays: it may hold deferred tokens the server still needs
                res.late_failures[sid] = wire.item_failure(sid, err, "Step")
        for i, (sid, n) in enumerate(self._pending):
            err = errors.get(("append", i))
            t = tracker.get(sid)
            if err is not None:
                res.appends[sid] = wire.item_failure(sid, err, "Step")
                continue
            num_tokens = m.append_num_tokens[i]
            if t is not None:
                if num_tokens != t.num_tokens + n:
                    tracker.forget(sid)
                    res.appends[sid] = ItemFailure(sid, StepStateError(
                        f"sequence {sid!r}: the server holds {num_tokens} tokens, the client expected "
                        f"{t.num_tokens + n} (was it changed by another client?)", method="Step",
                    ))
                    continue
                t.num_tokens = num_tokens
                t.num_deferred, t.deferred_token_ids = 0, []
                t.tail_exclusive = True
            res.appends[sid] = SeqSlots(sid, n, num_tokens)
        res.host_usable = {PoolId(f.pool_id): int(f.host_usable_blocks) for f in m.pool_free if f.host_usable_blocks}
        for i, sid in enumerate(self._swap_out):
            err = errors.get(("swap_out", i))
            res.swapped_out[sid] = None if err is None else wire.item_failure(sid, err, "Step")
        swapped_in = dict(zip(m.swapped_in_seq_ids, m.swapped_in_num_tokens))
        for i, sid in enumerate(self._swap_in):
            err = errors.get(("swap_in", i))
            if err is not None or sid not in swapped_in:
                res.swapped_in[sid] = wire.item_failure(sid, err, "Step") if err is not None else ItemFailure(
                    sid, StepStateError(f"sequence {sid!r}: swap-in not answered", method="Step"))
                continue
            res.swapped_in[sid] = int(swapped_in[sid])
        for ps in m.steps:
            info = wire.pool_step(ps)
            res.steps[info.pool_id] = info
            tracker.apply_step(info)
        for sid, swapped in res.swapped_in.items():
            if not isinstance(swapped, ItemFailure):
                pool = next((ps.pool_id for ps in m.steps if sid in ps.delta_seq_ids), None)
                if pool is not None:   # forks swapped in together share their tail: no local appends
                    tracker.track(sid, PoolId(pool), swapped, tail_exclusive=False)
        return res

    def distrust(self, request: pb.StepRequest) -> None:
        """The RPC's outcome is unknown: only the server may answer for the sequences `request`
        names now. Appends this step answered locally are not in it: their sequences stay
        tracked, deferred tokens included (forgetting them would lose tokens the server has
        never heard of). `request` is kept for `resend`."""
        self._unanswered = request
        for ids in (request.append_seq_ids, request.written_seq_ids, request.fork_parent_ids,
                    request.fork_child_ids, request.alloc_seq_ids, request.late_seq_ids):
            for sid in ids:
                self._tracker.forget(SeqId(sid))

    def answered(self) -> None:
        """The resent request got its answer: nothing is left to resend."""
        self._unanswered = None

    def unanswered(self) -> pb.StepRequest:
        """The request whose commit failed (what `resend` repeats, request id included)."""
        if self._unanswered is None:
            raise InvalidArgumentError("nothing to resend: the step was not committed or it was answered",
                                       method="Step")
        return self._unanswered


__all__ = ["SequenceTracker", "StepBatch", "StepResult", "TrackedSequence"]
