"""`BlockManager`: the deterministic state machine over pools, sequences and blocks.

Every public method either raises a `CoreError` before touching anything or completes
fully, so the service can journal a call and replay it to the same state. Nothing here
reads a clock, draws random numbers or iterates an unordered collection whose order
could leak into a result.

The one-sequencer contract (steps.py): everything a call changes in a pool's memory is
recorded in the pool's open step; `close_step` hands it to the scheduler, whose Forward for
the step runs the step's copy ops (copy-on-write, defrag moves) before any of its writes and
applies its table deltas; the scheduler reports the Forward with `settle_steps`. A block is a
defrag or copy-on-write source only once the step that wrote it is settled, a defrag plan
commits when the step carrying its moves is settled, and a failed step drops what it wrote.
So even when a copy's source is released and handed to another sequence in the same step,
the copy still reads the old content: the new owner's writes come after the step's copies.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from block_manager.core.errors import (
    CoreError,
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    PendingWrite,
    PoolDraining,
    SequenceExists,
    StepsUnsettled,
    UnknownPlan,
    UnknownPool,
    UnknownSequence,
    VersionConflict,
)
from block_manager.core.hashing import hash_prefix, token_array
from block_manager.core.slots import slot_range

from . import defrag as _defrag
from .append import AppendOutcome, append_columns, item_error
from .fsck import fsck
from .pool import MAX_POOL_BLOCKS, Pool
from .sequence import Sequence
from .snapshot import CoreParts, from_snapshot, to_snapshot
from .steps import StepRecord, StepWork, base_step, build_output, note_created, note_dropped
from .types import (
    AllocateResult,
    AppendFailure,
    AppendRequest,
    AppendResult,
    BlockId,
    CopyOp,
    DefragKind,
    DefragPlan,
    DefragPolicy,
    PlanId,
    PoolId,
    PoolMetrics,
    RouteEntry,
    SeqId,
    SequenceView,
    SettleResult,
    StepId,
    StepOutput,
)

DEFAULT_MAX_UNSETTLED_STEPS = 4


def _check_count(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidRequest(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class BlockManager:
    """Pools, sequences and their block tables; see docs/core_api.md for the contract."""

    def __init__(
        self,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        defrag_policy: DefragPolicy | None = None,
        max_unsettled_steps: int = DEFAULT_MAX_UNSETTLED_STEPS,
    ) -> None:
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not (
            0.0 <= watermark < 1.0
        ):
            raise InvalidRequest(f"watermark must be in [0, 1), got {watermark!r}")
        self.watermark = float(watermark)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.defrag_policy = defrag_policy if defrag_policy is not None else DefragPolicy()
        self.max_unsettled_steps = _check_count("max_unsettled_steps", max_unsettled_steps, 1)
        self._pools: dict[PoolId, Pool] = {}
        self._seqs: dict[SeqId, Sequence] = {}
        self._next_plan_id = 1

    # ---- lookups --------------------------------------------------------------------
    def _pool(self, pool_id: PoolId) -> Pool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise UnknownPool(f"unknown pool {pool_id!r}")
        return pool

    def _seq(self, seq_id: SeqId) -> Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"unknown sequence {seq_id!r}")
        return seq

    def _watermark_blocks(self, pool: Pool) -> int:
        return int(self.watermark * pool.num_blocks)

    @property
    def pool_ids(self) -> list[PoolId]:
        return list(self._pools)

    # ---- pools ----------------------------------------------------------------------
    def add_pool(self, pool_id: PoolId, num_blocks: int, block_size: int) -> None:
        if not isinstance(pool_id, str) or not pool_id:
            raise InvalidRequest(f"pool id must be a non-empty string, got {pool_id!r}")
        if pool_id in self._pools:
            raise InvalidRequest(f"pool {pool_id!r} already exists")
        _check_count("num_blocks", num_blocks, 1)
        _check_count("block_size", block_size, 1)
        if num_blocks > MAX_POOL_BLOCKS:
            raise InvalidRequest(f"num_blocks {num_blocks} exceeds {MAX_POOL_BLOCKS}")
        self._pools[pool_id] = Pool(pool_id, num_blocks, block_size)

    def remove_pool(self, pool_id: PoolId) -> list[SeqId]:
        """Drop a pool with its sequences, pending ops and plan; returns the dropped ids."""
        pool = self._pool(pool_id)
        dropped = list(pool.seqs)
        for sid in dropped:
            del self._seqs[sid]
        del self._pools[pool_id]
        return dropped

    def set_draining(self, pool_id: PoolId, draining: bool) -> None:
        self._pool(pool_id).draining = bool(draining)

    # ---- allocation -----------------------------------------------------------------
    def can_allocate(self, pool_id: PoolId, num_tokens: int) -> bool:
        """Whether a fresh (uncached) prompt of `num_tokens` would be admitted now."""
        pool = self._pool(pool_id)
        _check_count("num_tokens", num_tokens, 1)
        if pool.draining:
            return False
        needed = -(-num_tokens // pool.block_size)
        return needed <= pool.num_available - self._watermark_blocks(pool)

    def allocate(
        self,
        seq_id: SeqId,
        pool_id: PoolId,
        token_ids: Seq[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: str | None = None,
        num_compute: int | None = None,
    ) -> AllocateResult:
        """Create a sequence for a prompt, reusing prefix-cached full blocks.

        All or nothing. Admission keeps `watermark * num_blocks` free-or-evictable blocks
        in reserve for running sequences' appends. When every block of the prompt is
        cached, the last block is still computed (num_cached_tokens <= num_tokens - 1):
        the model needs at least one query token to produce the next token's logits, and
        recomputing a whole block keeps the slot mapping block-aligned.
        Passing `num_tokens` instead of `token_ids` disables hashing for the sequence.

        `num_compute` caps how many tokens beyond the cached prefix get slots now (chunked
        prefill): the prefix lookup still sees the whole prompt, the sequence holds
        `num_cached_tokens + min(num_compute, rest)` tokens, and the scheduler appends the
        rest of the prompt (with its token ids) in later steps. The new tokens' slots are
        recorded in the pool's open step.
        """
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidRequest(f"sequence id must be a non-empty string, got {seq_id!r}")
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} already exists")
        pool = self._pool(pool_id)
        if pool.draining:
            raise PoolDraining(f"pool {pool_id!r} is draining")
        if (token_ids is None) == (num_tokens is None):
            raise InvalidRequest("give exactly one of token_ids and num_tokens")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest(f"salt must be a string or None, got {type(salt).__name__}")
        if num_compute is not None:
            _check_count("num_compute", num_compute, 1)
        tokens = token_array(token_ids) if token_ids is not None else None
        prompt_len = len(tokens) if tokens is not None else _check_count("num_tokens", num_tokens, 1)
        if prompt_len == 0:
            raise InvalidRequest("empty prompt")
        bs = pool.block_size
        hashing = tokens is not None and self.enable_prefix_caching
        hashes = hash_prefix(tokens, bs, salt) if hashing else []
        hits = self._prefix_hits(pool, tokens, hashes, salt) if hashing else []
        total = prompt_len
        if num_compute is not None:
            total = min(prompt_len, len(hits) * bs + num_compute)
            if tokens is not None:
                tokens = tokens[:total]
            hashes = hashes[: total // bs]
        num_new = -(-total // bs) - len(hits)
        hits_in_queue = sum(1 for b in hits if pool.ref_cnt[b] == 0)
        available = pool.num_available - hits_in_queue - self._watermark_blocks(pool)
        if num_new > available:
            raise OutOfBlocks(
                f"pool {pool_id!r}: {num_new} blocks needed, {max(available, 0)} available "
                f"above the watermark"
            )

        for b in hits:
            pool.share_block(b)
        table = hits + [pool.take_block() for _ in range(num_new)]
        # the pool's own id object: the batched append tells pools apart by identity
        seq = Sequence(seq_id, pool.pool_id, table, total, pool.new_version(), salt, hashing)
        num_cached = len(hits) * bs
        step = pool.step
        step.has_writes = True
        seq.last_step = seq.last_write_step = step.step_id
        for b in table[len(hits) :]:
            pool.write_step[b] = step.step_id
        if hashing:
            parent = hashes[len(hits) - 1] if hits else None
            for i in range(len(hits), len(hashes)):
                block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
                if pool.register(table[i], hashes[i], parent, salt, block_tokens):
                    step.registrations.append((table[i], hashes[i]))
                parent = hashes[i]
            seq.block_hashes = hashes
            seq.tail_token_ids = tokens[len(hashes) * bs :].tolist()
            pool.prefix_query_tokens += prompt_len
            pool.prefix_hit_tokens += num_cached
        self._seqs[seq_id] = seq
        pool.seqs[seq_id] = seq
        note_created(step, seq, num_cached)
        return AllocateResult(
            seq_id, pool_id, tuple(table), num_cached, slot_range(table, bs, num_cached, total),
            seq.version,
        )

    def _prefix_hits(
        self, pool: Pool, tokens: array, hashes: list[bytes], salt: str | None
    ) -> list[int]:
        """Blocks of the longest cached prefix, capped to leave one token to compute.

        A hit is read, never written, by the new sequence's Forward: blocks whose writing
        step is reported complete count, and so do blocks filled in this very step (the
        node writes a layer's K/V before that layer's attention reads it). A block filled by
        a step still in flight is not a hit."""
        bs = pool.block_size
        max_hits = min(len(hashes), (len(tokens) - 1) // bs)
        hits: list[int] = []
        parent = None
        for i in range(max_hits):
            b = pool.lookup(hashes[i], parent, salt, tuple(tokens[i * bs : (i + 1) * bs]))
            if b is None or not (pool.written(b) or pool.write_step[b] == pool.step.step_id):
                break
            hits.append(b)
            parent = hashes[i]
        return hits

    def can_append(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        """Whether `append_slots` would succeed for this sequence alone (appends may use
        the watermark reserve; a copy-on-write needs its source's step settled)."""
        seq = self._seq(seq_id)
        _check_count("num_new_tokens", num_new_tokens, 1)
        pool = self._pools[seq.pool_id]
        bs = pool.block_size
        needed = -(-(seq.num_tokens + num_new_tokens) // bs) - len(seq.block_table)
        if seq.num_tokens % bs and pool.ref_cnt[seq.block_table[-1]] > 1:
            if not pool.written(seq.block_table[-1]):
                return False  # the copy-on-write source is not written yet (PendingWrite)
            needed += 1
        return needed <= pool.num_available

    def append_tokens(
        self,
        seq_ids: Seq[SeqId],
        num_new_tokens: Seq[int],
        token_ids: Seq[int] | None = None,
        *,
        already_written: bool = False,
    ) -> AppendOutcome:
        """Add tokens to a batch of sequences (one scheduler step), columnar: sequence i gets
        `num_new_tokens[i]` tokens; `token_ids` holds all their ids back to back (or is None:
        hashing then stops for those sequences, the chain cannot continue without content).

        Per sequence: blocks added at block boundaries, and a copy-on-write op when the
        partial last block is shared (ref_cnt > 1: the sequence gets a fresh block, the node
        copies the old one first — only once the step that wrote that block is settled,
        `PendingWrite` otherwise). A sequence that fails (unknown, malformed, out of blocks)
        is listed in `failures` and is unchanged; the others proceed in request order. The
        new tokens' slots follow from the tables (`slot_range`), which reach the node as the
        step's deltas. Counts one step for each pool touched.

        `already_written=True` reports tokens the scheduler already wrote into the
        sequence's exclusive partial last block without asking (see append.py).
        """
        return append_columns(self._pools, self._seqs, seq_ids, num_new_tokens, token_ids,
                              already_written=already_written)

    def append_slots(
        self, requests: Seq[AppendRequest], *, already_written: bool = False
    ) -> list[AppendResult | AppendFailure]:
        """`append_tokens` with one request object per sequence and, per sequence, its new
        tokens' slots, the blocks it gained and its copy-on-write op (what an embedding
        scheduler that drives its workers directly wants)."""
        reqs = list(requests)
        seqs = self._seqs
        before = {i: (seq.num_tokens, len(seq.block_table)) for i, r in enumerate(reqs)
                  if (seq := seqs.get(r.seq_id)) is not None}
        if all(r.token_ids is None for r in reqs) or all(
            r.token_ids is not None and len(r.token_ids) == r.num_new_tokens for r in reqs
        ):
            # The common batch: one columnar append, whose screen finds every item error.
            ids = None if not reqs or reqs[0].token_ids is None else [t for r in reqs for t in r.token_ids]  # type: ignore[union-attr]
            out = append_columns(self._pools, seqs, [r.seq_id for r in reqs], [r.num_new_tokens for r in reqs],
                                 ids, already_written=already_written)
            bad: dict[int, CoreError] = dict(out.failures)
            ops = out.copy_ops
        else:
            bad, ops = self._append_slots_itemwise(reqs, already_written)
        results: list[AppendResult | AppendFailure] = []
        pools = self._pools
        for i, r in enumerate(reqs):
            err = bad.get(i)
            if err is not None:
                results.append(AppendFailure(r.seq_id, err))
                continue
            seq = seqs[r.seq_id]
            old, old_len = before[i]
            op = ops.get(i)
            table = seq.block_table
            nt = seq.num_tokens
            bs = pools[seq.pool_id].block_size
            # decode (one token) is the common case: its slot without building ranges
            slots = (table[old // bs] * bs + old % bs,) if nt - old == 1 else slot_range(table, bs, old, nt)
            results.append(AppendResult(   # block ids are plain ints at run time (BlockId is a NewType)
                r.seq_id, slots, tuple(table[old_len:]), (op,) if op is not None else (), seq.version, nt,
            ))
        return results

    def _append_slots_itemwise(
        self, reqs: list[AppendRequest], already_written: bool
    ) -> tuple[dict[int, CoreError], dict[int, CopyOp]]:
        """`append_slots` of a batch whose items' token tuples disagree with their counts (a
        flat list cannot say which) or that mixes items with and without token ids: each
        item validated alone, then columnar runs (mixed: one item at a time). Several runs
        are still one scheduler step: each pool counts it once (the defrag policy's
        `every_n_steps` cadence reads the count)."""
        bad: dict[int, CoreError] = {}
        seen: set[str] = set()
        for i, r in enumerate(reqs):
            err = item_error(self._seqs, self._pools, seen, r.seq_id, r.num_new_tokens, r.token_ids, already_written)
            if err is not None:
                bad[i] = err
            if r.seq_id in self._seqs:
                seen.add(r.seq_id)
        good = [i for i in range(len(reqs)) if i not in bad]
        with_ids = [i for i in good if reqs[i].token_ids is not None]
        runs = [good] if len(with_ids) in (0, len(good)) else [[i] for i in good]
        ops: dict[int, CopyOp] = {}
        steps_before = {pid: pool.num_steps for pid, pool in self._pools.items()}
        for run in runs:
            rs = [reqs[i] for i in run]
            ids = None if rs and rs[0].token_ids is None else [t for r in rs for t in r.token_ids]  # type: ignore[union-attr]
            out = append_columns(self._pools, self._seqs, [r.seq_id for r in rs], [r.num_new_tokens for r in rs],
                                 ids, already_written=already_written)
            for j, err in out.failures:
                bad[run[j]] = err
            for j, op in out.copy_ops.items():
                ops[run[j]] = op
        for pid, num_steps in steps_before.items():
            pool = self._pools[pid]
            pool.num_steps = min(pool.num_steps, num_steps + 1)
        return bad, ops

    def fork(self, parent: SeqId, child_ids: Seq[SeqId]) -> list[SequenceView]:
        """Children share every block of the parent (ref counts up, nothing copied); the
        first write into a shared partial block triggers copy-on-write."""
        src = self._seq(parent)
        children = list(child_ids)
        if not children:
            raise InvalidRequest("fork needs at least one child id")
        if len(set(children)) != len(children):
            raise InvalidRequest("duplicate child ids")
        for cid in children:
            if not isinstance(cid, str) or not cid:
                raise InvalidRequest(f"sequence id must be a non-empty string, got {cid!r}")
            if cid in self._seqs:
                raise SequenceExists(f"sequence {cid!r} already exists")
        pool = self._pools[src.pool_id]
        if pool.draining:
            raise PoolDraining(f"pool {src.pool_id!r} is draining")
        views: list[SequenceView] = []
        step = pool.step
        for cid in children:
            for b in src.block_table:
                pool.share_block(b)
            child = Sequence(
                cid, src.pool_id, list(src.block_table), src.num_tokens, pool.new_version(), src.salt,
                src.hashing, list(src.tail_token_ids), list(src.block_hashes),
                # A child's table is announced in this step: if the step fails the node never
                # learns it (and the parent's unsettled writes are the child's too).
                last_step=step.step_id,
            )
            self._seqs[cid] = child
            pool.seqs[cid] = child
            note_created(step, child, src.num_tokens)
            views.append(child.view())
        return views

    def free(self, seq_ids: Seq[SeqId]) -> None:
        """Release sequences. Full hashed blocks that drop to ref_cnt 0 stay cached (the
        sequence's tail is evicted first); other blocks are free at once. All or nothing;
        `PendingWrite` for a sequence with tokens to write in its pool's open step."""
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise InvalidRequest("duplicate sequence ids in free")
        for sid in ids:
            self.check_can_free(sid)
        for sid in ids:
            self._drop(sid)

    def check_can_free(self, seq_id: SeqId) -> None:
        """`UnknownSequence`, or `PendingWrite` when the sequence has tokens to write in its
        pool's open step (its writes, which forks and prefix hits may share, would never run)."""
        seq = self._seq(seq_id)
        open_id = self._pools[seq.pool_id].step.step_id
        if seq.last_write_step == open_id:
            raise PendingWrite(
                f"sequence {seq_id!r} has tokens to write in open step {open_id} of pool {seq.pool_id!r}; "
                "close the step and run its Forward before freeing it"
            )

    def _drop(self, seq_id: SeqId) -> None:
        seq = self._seqs.pop(seq_id)
        pool = self._pools[seq.pool_id]
        del pool.seqs[seq_id]
        for b in reversed(seq.block_table):
            pool.release_block(b)
        note_dropped(pool.step, seq_id)

    # ---- views ----------------------------------------------------------------------
    def get_sequence(self, seq_id: SeqId) -> SequenceView:
        return self._seq(seq_id).view()

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def pools_of(self, seq_ids: Seq[SeqId]) -> set[PoolId]:
        """The pools of the known sequences among `seq_ids` (unknown ones are skipped);
        cheap: no view is built (a Step asks this for every sequence it names)."""
        get = self._seqs.get
        return {s.pool_id for s in map(get, seq_ids) if s is not None}

    def get_tables(
        self, seq_ids: Seq[SeqId], known_versions: Mapping[SeqId, int] | None = None
    ) -> list[SequenceView]:
        """Views of the sequences whose table is newer than the caller's version."""
        known = known_versions or {}
        seqs = [self._seq(sid) for sid in seq_ids]
        out: list[SequenceView] = []
        for seq in seqs:
            have = known.get(seq.seq_id)
            if have is not None and have > seq.version:
                raise VersionConflict(
                    f"sequence {seq.seq_id!r}: caller has version {have}, core {seq.version}"
                )
            if have is None or have < seq.version:
                out.append(seq.view())
        return out

    def sequences(self, pool_id: PoolId | None = None) -> list[SequenceView]:
        if pool_id is None:
            return [s.view() for s in self._seqs.values()]
        return [s.view() for s in self._pool(pool_id).seqs.values()]

    # ---- steps ----------------------------------------------------------------------
    def open_step_id(self, pool_id: PoolId) -> StepId:
        """The step new work of the pool is recorded in."""
        return self._pool(pool_id).step.step_id

    def settled_step_id(self, pool_id: PoolId) -> int:
        """Every step of the pool up to this one is reported (complete or failed)."""
        return self._pool(pool_id).settled_step

    def unsettled_step_ids(self, pool_id: PoolId) -> list[StepId]:
        """Closed steps whose Forward is not reported yet, oldest first."""
        return [r.step_id for r in self._pool(pool_id).unsettled]

    def writers_since(self, pool_id: PoolId, step_id: int) -> list[SeqId]:
        """The sequences a failure of `step_id` (and later steps) would drop."""
        return [sid for sid, seq in self._pool(pool_id).seqs.items() if seq.last_touched_step >= step_id]

    def abandon_pool(self, pool_id: PoolId) -> list[SeqId]:
        """Hand the pool to a new scheduler: drop every sequence (the old scheduler's), count its
        unsettled steps as failed (their hashes forgotten), abort its plan, and make the next
        step a reset (the node forgets every table of the pool). Returns the dropped ids."""
        pool = self._pool(pool_id)
        if pool.plan is not None:
            _defrag.abort(pool)
        dropped = list(pool.seqs)
        for sid in dropped:
            seq = self._seqs.pop(sid)
            del pool.seqs[sid]
            for b in reversed(seq.block_table):
                pool.release_block(b)
        for registrations in [*(r.registrations for r in pool.unsettled), pool.step.registrations]:
            for b, block_hash in registrations:
                pool.unregister(b, block_hash)
        pool.unsettled = []
        pool.settled_step = pool.step.step_id - 1
        # The open step's own work belonged to the old scheduler too: the next step only resets.
        pool.step = StepWork(pool.step.step_id, reset=True, base_step_id=0)
        return dropped

    def can_close_step(self, pool_id: PoolId) -> bool:
        """Whether `close_step` would hand out a step now (it has work and the pool is below
        its limit of unsettled steps)."""
        pool = self._pool(pool_id)
        return pool.step.has_work and len(pool.unsettled) < self.max_unsettled_steps

    def close_step(self, pool_id: PoolId, *, force: bool = False) -> StepOutput | None:
        """Close the pool's open step and hand it to the scheduler (None: it has no work).

        Table changes alone (new, rewritten or dropped tables) do not close a step: they wait
        for the next step that writes (its Forward applies them first). `force=True` hands
        them out anyway (a scheduler that wants its nodes' tables in sync now).
        `StepsUnsettled` (state unchanged, the work stays in the open step) when
        `max_unsettled_steps` closed steps already await their Forward report.
        """
        pool = self._pool(pool_id)
        step = pool.step
        if not (step.has_work or (force and (step.dirty or step.dropped))):
            return None
        if len(pool.unsettled) >= self.max_unsettled_steps:
            raise StepsUnsettled(
                f"pool {pool_id!r}: steps {[r.step_id for r in pool.unsettled]} await their Forward report; "
                f"settle them before closing step {step.step_id}"
            )
        out = build_output(pool_id, step, pool.seqs)
        pool.unsettled.append(StepRecord(step.step_id, step.registrations, step.plan_id, base_step(step)))
        pool.step = StepWork(StepId(step.step_id + 1))
        return out

    def close_steps(self) -> list[StepOutput]:
        """Close the open step of every pool that has work, in pool order."""
        return [out for pid in list(self._pools) if self.can_close_step(pid) and (out := self.close_step(pid))]

    def settle_steps(self, pool_id: PoolId, completed_up_to: int, failed_from: int | None = None) -> SettleResult:
        """The scheduler's report of its Forwards: every closed step up to `completed_up_to`
        ran; every closed step from `failed_from` on (which must directly follow the completed
        ones) did not.

        Completed: their blocks count as written; a defrag plan whose moves they carried
        commits (its table rewrites go into the open step, to be delivered with the next
        one). Failed: their plan aborts, the sequences they wrote are dropped (their K/V is
        missing; announced as dropped in the open step), and the prefix-cache hashes of the
        blocks they filled are forgotten. Reporting an already settled step again is a no-op.
        """
        pool = self._pool(pool_id)
        _check_count("completed_up_to", completed_up_to, 0)
        last_closed = pool.last_closed_step
        if completed_up_to > last_closed:
            raise StepsUnsettled(
                f"pool {pool_id!r}: step {completed_up_to} was never handed out (last closed step {last_closed})"
            )
        done = max(completed_up_to, pool.settled_step)
        if failed_from is not None:
            _check_count("failed_from", failed_from, 1)
            if failed_from <= done:
                raise InvalidRequest(
                    f"pool {pool_id!r}: step {failed_from} is reported failed but is already settled "
                    f"(settled up to {done})"
                )
            if failed_from != done + 1:
                raise InvalidRequest(
                    f"pool {pool_id!r}: a failed step must directly follow the completed ones "
                    f"(completed up to {done}, failed from {failed_from})"
                )
            if failed_from > last_closed:
                raise StepsUnsettled(f"pool {pool_id!r}: step {failed_from} was never handed out")
        committed: list[PlanId] = []
        aborted: list[PlanId] = []
        dropped: list[SeqId] = []
        pool.settled_step = done
        pool.unsettled = [r for r in pool.unsettled if r.step_id > done]
        if pool.plan is not None and pool.plan.step_id <= done:
            committed.append(pool.plan.plan_id)
            _defrag.commit(pool)
        if failed_from is not None and failed_from > done:
            failed = pool.unsettled
            pool.unsettled = []
            pool.settled_step = last_closed
            # The next step builds on what the first failed step was built on: the node holds
            # that state and lacks every failed step (`failed_from - 1` may itself have failed
            # in an earlier report, so it is not necessarily applied).
            pool.step.base_step_id = failed[0].base_step_id
            if pool.plan is not None and pool.plan.step_id >= failed_from:
                aborted.append(pool.plan.plan_id)
                _defrag.abort(pool)
            dropped = [sid for sid, seq in pool.seqs.items() if seq.last_touched_step >= failed_from]
            for sid in dropped:
                self._drop(sid)
            for record in failed:
                for b, block_hash in record.registrations:
                    pool.unregister(b, block_hash)
        return SettleResult(pool_id, StepId(pool.settled_step), tuple(committed), tuple(aborted), tuple(dropped))

    # ---- prefix cache ---------------------------------------------------------------
    def route(self, token_ids: Seq[int], salt: str | None = None) -> list[RouteEntry]:
        """Pools that admit new sequences, best first: longest cached prefix, then most
        free-or-evictable blocks, then pool id."""
        tokens = token_array(token_ids)
        if not tokens:
            raise InvalidRequest("empty prompt")
        hashes_by_size: dict[int, list[bytes]] = {}
        entries: list[RouteEntry] = []
        for pool in self._pools.values():
            if pool.draining:
                continue
            cached = 0
            if self.enable_prefix_caching:
                hashes = hashes_by_size.get(pool.block_size)
                if hashes is None:
                    hashes = hash_prefix(tokens, pool.block_size, salt)
                    hashes_by_size[pool.block_size] = hashes
                cached = len(self._prefix_hits(pool, tokens, hashes, salt)) * pool.block_size
            entries.append(RouteEntry(pool.pool_id, cached, pool.num_available))
        entries.sort(key=lambda e: (-e.num_cached_tokens, -e.num_free_blocks, e.pool_id))
        return entries

    def evict(self, pool_id: PoolId, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks (LRU); returns how many were evicted."""
        pool = self._pool(pool_id)
        _check_count("num_blocks", num_blocks, 0)
        return pool.evict(num_blocks)

    def reset_prefix_cache(self, pool_id: PoolId | None = None) -> int:
        """Forget all content hashes (of one pool or all); cached blocks become free.
        Returns the number of cached blocks dropped."""
        pools = [self._pool(pool_id)] if pool_id is not None else list(self._pools.values())
        return sum(p.reset_prefix_cache() for p in pools)

    # ---- defragmentation ------------------------------------------------------------
    def plan_defrag(
        self, pool_id: PoolId, kind: DefragKind = "compaction", max_moves: int | None = None
    ) -> DefragPlan | None:
        """Reserve destinations and queue the copies of a defrag plan in the pool's open step
        (None: nothing to do). Only full blocks whose writing step is settled move; the plan
        commits when the step carrying its moves is settled (`settle_steps`) and aborts when
        that step fails. See `block_manager.core.defrag` for the algorithms."""
        pool = self._pool(pool_id)
        if kind not in ("compaction", "contiguity"):
            raise InvalidRequest(f"unknown defrag kind {kind!r}")
        if max_moves is not None:
            _check_count("max_moves", max_moves, 1)
        if pool.plan is not None:
            raise FailedPrecondition(
                f"pool {pool_id!r} already has outstanding plan {pool.plan.plan_id}"
            )
        if kind == "compaction":
            pairs = _defrag.plan_compaction(pool, max_moves)
        else:
            pairs = _defrag.plan_contiguity(pool, max_moves)
        if not pairs:
            return None
        plan_id = PlanId(self._next_plan_id)
        self._next_plan_id += 1
        state = _defrag.reserve(pool, plan_id, kind, pairs)
        return DefragPlan(plan_id, pool_id, kind, tuple(state.moves), state.step_id)

    def _plan_pool(self, plan_id: PlanId) -> Pool:
        for pool in self._pools.values():
            if pool.plan is not None and pool.plan.plan_id == plan_id:
                return pool
        raise UnknownPlan(f"unknown defrag plan {plan_id!r}")

    def abort_defrag(self, plan_id: PlanId) -> None:
        """Roll a plan back: destinations return to the free queue, sources are unpinned.
        The moves may still run in their step's Forward: harmless, since a released
        destination's next owner writes only in a later step (after that step's copies)."""
        pool = self._plan_pool(plan_id)
        _defrag.abort(pool)

    def get_defrag_plan(self, pool_id: PoolId) -> DefragPlan | None:
        pool = self._pool(pool_id)
        if pool.plan is None:
            return None
        p = pool.plan
        return DefragPlan(p.plan_id, pool_id, p.kind, tuple(p.moves), p.step_id)

    def defrag_due(self, pool_id: PoolId) -> DefragKind | None:
        """Which defragmentation the policy asks for now ("compaction"/"contiguity"), or
        None. Pure query: it changes nothing."""
        return _defrag.due(self._pool(pool_id), self.defrag_policy)

    # ---- metrics, fsck, snapshots ---------------------------------------------------
    def metrics(self, pool_id: PoolId) -> PoolMetrics:
        pool = self._pool(pool_id)
        bs = pool.block_size
        num_tokens = 0
        partial: dict[int, int] = {}
        for seq in pool.seqs.values():
            num_tokens += seq.num_tokens
            fill = seq.num_tokens % bs
            if fill:
                partial[seq.block_table[-1]] = fill
        waste = sum(bs - fill for fill in partial.values())
        return PoolMetrics(
            pool_id=pool.pool_id,
            num_blocks=pool.num_blocks,
            block_size=bs,
            num_free_blocks=pool.num_free,
            num_used_blocks=pool.num_used,
            num_cached_blocks=pool.num_cached,
            num_reserved_blocks=pool.num_reserved,
            usage=pool.num_used / pool.num_blocks,
            high_water_mark=pool.high_water_mark(),
            num_tokens=num_tokens,
            allocated_slots=pool.num_used * bs,
            waste_slots=waste,
            prefix_query_tokens=pool.prefix_query_tokens,
            prefix_hit_tokens=pool.prefix_hit_tokens,
            cow_copies=pool.cow_copies,
            evictions=pool.evictions,
            defrag_moves=pool.defrag_moves,
            compaction_plans=pool.compaction_plans,
            contiguity_plans=pool.contiguity_plans,
            aborted_plans=pool.aborted_plans,
            num_sequences=len(pool.seqs),
            contiguity=_defrag.contiguity_score(pool),
        )

    def fsck(self) -> list[str]:
        """Check every invariant; human-readable violations, empty when healthy."""
        return fsck(self._pools, self._seqs, self._next_plan_id)

    def to_snapshot(self) -> dict:
        """The complete state as a JSON-serialisable dict (see core/snapshot.py)."""
        return to_snapshot(
            CoreParts(
                self.watermark, self.enable_prefix_caching, self.defrag_policy,
                self._pools, self._seqs, self._next_plan_id, self.max_unsettled_steps,
            )
        )

    @classmethod
    def from_snapshot(cls, data: dict) -> BlockManager:
        """Rebuild a manager from `to_snapshot()` output; InvalidRequest if malformed or if
        the decoded state fails fsck."""
        parts = from_snapshot(data)
        manager = cls(
            watermark=parts.watermark,
            enable_prefix_caching=parts.enable_prefix_caching,
            defrag_policy=parts.defrag_policy,
            max_unsettled_steps=parts.max_unsettled_steps,
        )
        manager._pools, manager._seqs, manager._next_plan_id = parts.pools, parts.seqs, parts.next_plan_id
        problems = manager.fsck()
        if problems:
            raise InvalidRequest(f"snapshot fails fsck: {problems[:5]}")
        return manager


__all__ = ["BlockManager", "BlockId", "MAX_POOL_BLOCKS"]
