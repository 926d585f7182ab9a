"""Scheduler-step batching with local answers for in-block decode appends.

A scheduler step is: free finished sequences, admit new ones, fork, append the step's new
tokens. `StepBatch` collects those and issues them as at most Free + Allocate + Fork(s) +
ONE AppendSlots — and, in steady-state decode, usually no RPC at all, because most decode
appends land inside the sequence's last block and can be answered by the client.

Deferred appends (the correctness argument)
-------------------------------------------
The client tracks, per sequence it allocated or forked itself: pool, block size, the id of
the last block, `num_tokens` (including tokens not yet reported), the table version, and
whether the last block may be shared. An append of `n` tokens is answered locally iff

  * the last block is exclusively owned (`tail_exclusive`): it came from Allocate (a
    partial last block is never a prefix-cache hit: hits are full blocks only) or from a
    server append (which copy-on-writes a shared partial block), and no Fork touched the
    sequence since (after a Fork, parent and children all go to the server, which does CoW);
  * it stays strictly inside that block and does not fill it (`0 < num_tokens % bs` and
    `num_tokens % bs + n < bs`).

Then the slot is `last_block * bs + offset`, exactly what the server would compute,
because nobody else can touch that block: it is partial both in truth and in the server's
view, so it is never hashed, never shared by a prefix hit, never moved by defrag (only full
blocks move) and never evicted (ref_cnt 1); only a Fork could share it, and forks go through
this client (single writer per sequence — the scheduler that owns the sequence). The table
version does not change for in-block appends, so the compute node's cached table stays
valid; `Forward` carries the slots, the version and `context_len`, so the node needs nothing
from the block manager for such a step (it also checks the slots against its table).

The deferred tokens are reported, with their token ids, as the head of the sequence's next
server append (`num_new_tokens = deferred + new`): the server assigns slots for them again,
and the client checks that they equal the local ones (`StepStateError` otherwise). A block
is never *filled* by a deferred append, so the server always knows every full block in
time to hash it for prefix caching, and a Free of a sequence with deferred tokens loses
nothing (a partial block is never cached). If the block manager crashes before the report,
its recovered state simply lacks the deferred tokens and the next report re-appends them
into the same partial block at the same slots. A Fork first flushes the parent's deferred
tokens (one extra AppendSlots in that step) so the children inherit the true length. If the
node is fenced, its pool is dropped as a whole and the next server append fails with
FAILED_PRECONDITION; the re-registered node starts with an empty table cache and rejects
slots of sequences it cannot fetch.

A defrag commit may bump a sequence's version without this client hearing of it (it only
moves full blocks, never the partial last block the local slots use); the version a step
reports is then a lower bound, which is what `Forward` asks for ("a cached table at least
this new"), and the node refreshes from the block manager when its cache is older.

When a whole RPC of a step fails after the client's retries (its outcome is unknown), the
step stops answering locally for the sequences involved (they are untracked and go to the
server from then on); a Fork failure marks the parent's tail as possibly shared, and a Free
forgets its sequences before it is sent.

The server's `num_tokens` lags the truth by at most `block_size - 2` tokens per
sequence, all inside one partial block.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from block_manager.client.errors import BlockManagerError, InvalidArgumentError, StepStateError
from block_manager.client.types import AllocateSpec, ItemFailure
from block_manager.core.types import (
    AllocateResult,
    AppendRequest,
    AppendResult,
    BlockId,
    CopyOp,
    PoolId,
    SeqId,
    SequenceView,
)


@dataclass(slots=True)
class TrackedSequence:
    seq_id: SeqId
    pool_id: PoolId
    block_size: int
    last_block_id: BlockId
    num_tokens: int            # true length, deferred tokens included
    version: int
    tail_exclusive: bool
    num_deferred: int = 0
    deferred_slots: list[int] = field(default_factory=list)
    deferred_token_ids: list[int] | None = field(default_factory=list)  # None: some came without ids

    def can_append_locally(self, num_new_tokens: int) -> bool:
        offset = self.num_tokens % self.block_size
        return self.tail_exclusive and offset != 0 and offset + num_new_tokens < self.block_size

    def append_locally(self, num_new_tokens: int, token_ids: tuple[int, ...] | None) -> tuple[int, ...]:
        base = self.last_block_id * self.block_size + self.num_tokens % self.block_size
        slots = tuple(range(base, base + num_new_tokens))
        self.num_tokens += num_new_tokens
        self.num_deferred += num_new_tokens
        self.deferred_slots.extend(slots)
        if token_ids is None or self.deferred_token_ids is None:
            self.deferred_token_ids = None
        else:
            self.deferred_token_ids.extend(token_ids)
        return slots

    def server_request(self, num_new_tokens: int, token_ids: tuple[int, ...] | None) -> AppendRequest:
        """The deferred tokens followed by the step's new ones, as one append item."""
        ids: tuple[int, ...] | None = None
        if token_ids is not None and self.deferred_token_ids is not None:
            ids = (*self.deferred_token_ids, *token_ids)
        return AppendRequest(self.seq_id, self.num_deferred + num_new_tokens, ids)

    def apply_server_append(self, res: AppendResult, num_new_tokens: int) -> None:
        """Adopt the server's answer; `StepStateError` when it contradicts the local view."""
        d = self.num_deferred
        if res.num_tokens != self.num_tokens + num_new_tokens or list(res.slot_mapping[:d]) != self.deferred_slots:
            raise StepStateError(
                f"sequence {self.seq_id!r}: server assigned {res.num_tokens} tokens / slots "
                f"{list(res.slot_mapping[:d])} for the deferred appends, the client expected "
                f"{self.num_tokens + num_new_tokens} / {self.deferred_slots} (was it changed by another client?)",
                method="AppendSlots",
            )
        self.num_tokens = res.num_tokens
        self.last_block_id = BlockId(res.slot_mapping[-1] // self.block_size)
        self.version = res.version
        self.tail_exclusive = True
        self.num_deferred = 0
        self.deferred_slots = []
        self.deferred_token_ids = []


class SequenceTracker:
    """The client's view of the sequences it drives through steps (see module docstring).

    Pools whose block size is unknown are not tracked: their appends always go to the
    server, which is always correct, just not free.
    """

    def __init__(self, block_sizes: Mapping[str, int] | None = None) -> None:
        self.block_sizes: dict[str, int] = dict(block_sizes or {})
        self._seqs: dict[SeqId, TrackedSequence] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def set_block_size(self, pool_id: str, block_size: int) -> None:
        self.block_sizes[pool_id] = block_size

    def get(self, seq_id: str) -> TrackedSequence | None:
        return self._seqs.get(SeqId(seq_id))

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(SeqId(seq_id), None)

    def track_allocation(self, res: AllocateResult) -> None:
        bs = self.block_sizes.get(res.pool_id)
        if bs is None or not res.block_table:
            return
        num_tokens = res.num_cached_tokens + len(res.slot_mapping)
        self._seqs[res.seq_id] = TrackedSequence(
            res.seq_id, res.pool_id, bs, res.block_table[-1], num_tokens, res.version, True
        )

    def track_fork(self, parent: SeqId, children: Sequence[SequenceView]) -> None:
        t = self._seqs.get(parent)
        if t is not None:
            t.tail_exclusive = False
        for v in children:
            bs = self.block_sizes.get(v.pool_id)
            if bs is None or not v.block_table:
                continue
            self._seqs[v.seq_id] = TrackedSequence(
                v.seq_id, v.pool_id, bs, v.block_table[-1], v.num_tokens, v.version, False
            )


@dataclass(slots=True, frozen=True)
class SeqSlots:
    """What `Forward` needs for one sequence of the step."""

    seq_id: SeqId
    slot_mapping: tuple[int, ...]
    version: int
    context_len: int
    copy_ops: tuple[CopyOp, ...] = ()
    new_block_ids: tuple[BlockId, ...] = ()
    deferred: bool = False   # answered locally, reported with the sequence's next server append


@dataclass(slots=True)
class StepResult:
    allocations: dict[SeqId, AllocateResult | ItemFailure] = field(default_factory=dict)
    forks: dict[SeqId, tuple[SequenceView, ...]] = field(default_factory=dict)  # by parent
    appends: dict[SeqId, SeqSlots | ItemFailure] = field(default_factory=dict)
    num_freed: int = 0
    num_rpcs: int = 0

    @property
    def failures(self) -> list[ItemFailure]:
        items = [*self.allocations.values(), *self.appends.values()]
        return [x for x in items if isinstance(x, ItemFailure)]


@dataclass(slots=True, frozen=True)
class Call:
    """One client method call the step program wants made (`method(*args, **kwargs)`)."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


StepProgram = Generator[Call, Any, StepResult]


class StepBatch:
    """Collect one scheduler step, then `commit()` it (sync client) or `await commit()`.

    RPC order: Free, Allocate, [flush AppendSlots], Fork per parent, AppendSlots. Per-item
    failures land in the result; a whole-RPC error is raised, with `self.result` holding
    what the earlier RPCs of the step already did (the tracker reflects it too).
    """

    def __init__(self, client: Any, tracker: SequenceTracker, pool_epochs: Mapping[str, int] | None = None) -> None:
        self._client = client
        self._tracker = tracker
        self._pool_epochs = dict(pool_epochs or {})
        self._free_ids: list[SeqId] = []
        self._allocs: list[AllocateSpec] = []
        self._forks: list[tuple[SeqId, tuple[SeqId, ...]]] = []
        self._appends: dict[SeqId, tuple[int, tuple[int, ...] | None]] = {}
        self._committed = False
        self.result = StepResult()

    # ---- collecting -----------------------------------------------------------------
    def free(self, seq_ids: Sequence[str]) -> None:
        self._free_ids.extend(SeqId(s) for s in seq_ids)

    def allocate(
        self,
        seq_id: str,
        pool_id: str,
        token_ids: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: str | None = None,
    ) -> None:
        ids = tuple(token_ids) if token_ids is not None else None
        self._allocs.append(AllocateSpec(SeqId(seq_id), PoolId(pool_id), ids, num_tokens, salt))

    def fork(self, parent: str, child_ids: Sequence[str]) -> None:
        self._forks.append((SeqId(parent), tuple(SeqId(c) for c in child_ids)))

    def append(self, seq_id: str, token_ids: Sequence[int] | None = None, *, num_new_tokens: int | None = None) -> None:
        """Add new tokens to a sequence: `token_ids` (preferred: enables prefix caching of
        the blocks they fill) or a bare `num_new_tokens`."""
        sid = SeqId(seq_id)
        if sid in self._appends:
            raise InvalidArgumentError(f"sequence {seq_id!r} appended twice in one step", method="step")
        ids = tuple(token_ids) if token_ids is not None else None
        n = len(ids) if ids is not None else num_new_tokens
        if n is None or n < 1 or (num_new_tokens is not None and ids is not None and num_new_tokens != len(ids)):
            raise InvalidArgumentError(
                f"sequence {seq_id!r}: need >= 1 new token (token_ids or num_new_tokens)", method="step"
            )
        self._appends[sid] = (n, ids)

    # ---- the program both drivers run -----------------------------------------------
    def program(self) -> StepProgram:
        if self._committed:
            raise InvalidArgumentError("step already committed", method="step")
        self._committed = True
        res, tracker, epochs = self.result, self._tracker, self._pool_epochs
        if self._free_ids:
            # Forget first: after a Free whose answer was lost the blocks may already belong
            # to another sequence, so no slot may ever be computed locally for these again.
            for sid in self._free_ids:
                tracker.forget(sid)
            res.num_rpcs += 1
            res.num_freed = yield Call("free", (self._free_ids,), {"pool_epochs": epochs})
        if self._allocs:
            res.num_rpcs += 1
            outcomes = yield Call("allocate", (self._allocs,), {"pool_epochs": epochs})
            for spec, out in zip(self._allocs, outcomes, strict=True):
                res.allocations[spec.seq_id] = out
                if isinstance(out, AllocateResult):
                    tracker.track_allocation(out)
        if self._forks:
            # Children must inherit the true length: report the parents' deferred tokens first.
            flush = [t for p, _ in self._forks if (t := tracker.get(p)) is not None and t.num_deferred]
            if flush:
                res.num_rpcs += 1
                reqs = [t.server_request(0, ()) for t in flush]
                try:
                    outcomes = yield Call("append_slots", (reqs,), {"pool_epochs": epochs})
                except BlockManagerError:
                    self._distrust(t.seq_id for t in flush)
                    raise
                for t, out in zip(flush, outcomes, strict=True):
                    if isinstance(out, ItemFailure):
                        raise out.error
                    t.apply_server_append(out, 0)
            for parent, children in self._forks:
                res.num_rpcs += 1
                try:
                    views = yield Call("fork", (parent, children), {"pool_epochs": epochs})
                except BlockManagerError:
                    # The fork may have happened (answer lost): the parent's tail may be shared.
                    self._distrust([parent])
                    raise
                res.forks[parent] = tuple(views)
                tracker.track_fork(parent, views)
        if self._appends:
            items, pending = self._plan_appends()
            if items:
                res.num_rpcs += 1
                try:
                    outcomes = yield Call("append_slots", (items,), {"pool_epochs": epochs})
                except BlockManagerError:
                    # Applied or not is unknown: only the server may answer for these now.
                    self._distrust(sid for sid, _ in pending)
                    raise
                for (sid, n), out in zip(pending, outcomes, strict=True):
                    res.appends[sid] = self._server_outcome(sid, n, out)
        return res

    def _distrust(self, seq_ids: Iterable[SeqId]) -> None:
        """Stop answering locally for sequences whose server state became uncertain (a
        whole-RPC failure after retries may hide an applied request)."""
        for sid in seq_ids:
            self._tracker.forget(sid)

    def _plan_appends(self) -> tuple[list[AppendRequest], list[tuple[SeqId, int]]]:
        items: list[AppendRequest] = []
        pending: list[tuple[SeqId, int]] = []
        deferred = 0
        for sid, (n, ids) in self._appends.items():
            t = self._tracker.get(sid)
            if t is not None and t.can_append_locally(n):
                slots = t.append_locally(n, ids)
                deferred += n
                self.result.appends[sid] = SeqSlots(sid, slots, t.version, t.num_tokens, deferred=True)
                continue
            items.append(t.server_request(n, ids) if t is not None else AppendRequest(sid, n, ids))
            pending.append((sid, n))
        self._client.stats.deferred_tokens += deferred
        return items, pending

    def _server_outcome(self, sid: SeqId, n: int, out: AppendResult | ItemFailure) -> SeqSlots | ItemFailure:
        if isinstance(out, ItemFailure):
            return out
        t = self._tracker.get(sid)
        d = 0
        if t is not None:
            d = t.num_deferred
            try:
                t.apply_server_append(out, n)
            except StepStateError as exc:
                self._tracker.forget(sid)
                return ItemFailure(sid, exc)
        return SeqSlots(sid, out.slot_mapping[d:], out.version, out.num_tokens, out.copy_ops, out.new_block_ids)


def run_sync(batch: StepBatch) -> StepResult:
    """Drive a step program with a synchronous client (errors are thrown into the program,
    which updates its view and re-raises)."""
    program = batch.program()
    client = batch._client
    try:
        call = next(program)
        while True:
            try:
                answer = getattr(client, call.method)(*call.args, **call.kwargs)
            except BlockManagerError as exc:
                call = program.throw(exc)
                continue
            call = program.send(answer)
    except StopIteration as stop:
        return stop.value


async def run_async(batch: StepBatch) -> StepResult:
    """Drive a step program with an asyncio client."""
    program = batch.program()
    client = batch._client
    try:
        call = next(program)
        while True:
            try:
                answer = await getattr(client, call.method)(*call.args, **call.kwargs)
            except BlockManagerError as exc:
                call = program.throw(exc)
                continue
            call = program.send(answer)
    except StopIteration as stop:
        return stop.value


__all__ = ["SeqSlots", "SequenceTracker", "StepBatch", "StepResult", "TrackedSequence", "run_async", "run_sync"]
