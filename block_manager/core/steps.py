"""Steps: the unit in which a pool's memory changes, with the scheduler as its one sequencer.

Every change a call makes to a pool — slots assigned (tokens to write), copy-on-write copies,
defrag moves, tier moves, fetches, new / changed / dropped tables — is recorded in the pool's
*open* step (the records: step_work.py). Closing the step (`close_step`) hands the scheduler a
`StepOutput`: the copy ops to run and the table deltas to apply, in order, inside its Forward
for the step. The scheduler reports the Forward back (`settle_steps`): only then are the blocks
the step wrote known to hold their K/V, which is the condition for using a block as a defrag
source or a copy-on-write source. A defrag plan whose moves rode in a step commits when that
step is settled; a step reported failed aborts its plan, drops the sequences it wrote (their
K/V is missing) and unregisters the prefix-cache hashes of the blocks it filled, so no later
prefix hit can read unwritten memory.

Per block, `pool.write_step[b]` is the step that last assigned a slot in it; the block is
written once that step is settled (`write_step[b] <= pool.settled_step`).
"""

from __future__ import annotations

from block_manager.core import defrag as _defrag
from block_manager.core import fetch as _fetch
from block_manager.core.errors import InvalidRequest, StepsUnsettled, check_count
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence
from block_manager.core.step_work import StepRecord, StepWork, base_step, note_dropped
from block_manager.core.types import BlockId, PlanId, PoolId, SeqId, SettleResult, StepId, StepOutput, TableDelta


def build_output(pool_id: PoolId, step: StepWork, seqs: dict[SeqId, Sequence]) -> StepOutput:
    """The deltas and copy ops of a step, as its compute node must apply them."""
    deltas: list[TableDelta] = []
    for sid, d in step.dirty.items():
        seq = seqs[sid]
        table = seq.block_table
        # (block ids are plain ints at run time: BlockId is a NewType, so no conversion per block)
        if d.created:
            deltas.append(TableDelta(sid, 0, seq.version, d.covered, (), tuple(table)))  # type: ignore[arg-type]  # see above
        elif seq.version != d.base_version:
            replaced = tuple([(i, BlockId(table[i])) for i in sorted(d.replaced)]) if d.replaced else ()
            deltas.append(TableDelta(sid, d.base_version, seq.version, 0, replaced,
                                     tuple(table[d.base_len:])))  # type: ignore[arg-type]  # see above
    return StepOutput(
        pool_id,
        step.step_id,
        tuple(step.copy_ops),
        tuple(deltas),
        tuple(step.dropped),
        step.plan_id,
        step.reset,
        StepId(base_step(step)),
        tuple(step.tier_ops),
        tuple(step.fetches),
        tuple(step.serves),
    )


def drop_sequence(seqs: dict[SeqId, Sequence], pool: Pool, seq_id: SeqId) -> None:
    """Remove a sequence of `pool` (from the manager's index `seqs` too) and release its
    blocks, last first; a node that knows its table drops it with the open step."""
    seq = seqs.pop(seq_id)
    del pool.seqs[seq_id]
    for b in reversed(seq.block_table):
        pool.release_block(b)
    seq.release()
    note_dropped(pool.step, seq_id)


def close_step(pool: Pool, max_unsettled_steps: int, force: bool) -> StepOutput | None:
    """`BlockManager.close_step`: the open step handed out, a new one opened.

    Table changes alone (new, rewritten or dropped tables) do not close a step: they wait for
    the next step that writes (its Forward applies them first). `force` hands them out anyway
    (a scheduler that wants its nodes' tables in sync now). `StepsUnsettled` (state unchanged,
    the work stays in the open step) when `max_unsettled_steps` closed steps already await
    their Forward report."""
    step = pool.step
    if not (step.has_work or (force and (step.dirty or step.dropped))):
        return None
    if len(pool.unsettled) >= max_unsettled_steps:
        raise StepsUnsettled(
            f"pool {pool.pool_id!r}: steps {[r.step_id for r in pool.unsettled]} await their Forward report; "
            f"settle them before closing step {step.step_id}"
        )
    out = build_output(pool.pool_id, step, pool.seqs)
    pool.unsettled.append(StepRecord(step.step_id, step.registrations, step.plan_id, base_step(step)))
    pool.step = StepWork(StepId(step.step_id + 1))
    return out


def _check_report(pool: Pool, completed_up_to: int, failed_from: int | None) -> int:
    """Validate a settle report (nothing changes); the step settled up to once it applies."""
    pool_id = pool.pool_id
    check_count("completed_up_to", completed_up_to, 0)
    last_closed = pool.last_closed_step
    if completed_up_to > last_closed:
        raise StepsUnsettled(
            f"pool {pool_id!r}: step {completed_up_to} was never handed out (last closed step {last_closed})"
        )
    done = max(completed_up_to, pool.settled_step)
    if failed_from is not None:
        check_count("failed_from", failed_from, 1)
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
    return done


def _fail(seqs: dict[SeqId, Sequence], pool: Pool, failed_from: int) -> tuple[list[PlanId], list[SeqId]]:
    """Every closed step from `failed_from` on failed: (aborted plans, dropped sequences)."""
    last_closed = pool.last_closed_step
    aborted: list[PlanId] = []
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
        drop_sequence(seqs, pool, sid)
    for record in failed:
        for b, block_hash in record.registrations:
            pool.unregister(b, block_hash)
    if pool.host is not None:
        dropped.extend(pool.host.fail_from(failed_from, last_closed))
        pool.host.release_holds(last_closed)
    return aborted, dropped


def settle_steps(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], pool: Pool, completed_up_to: int,
                 failed_from: int | None) -> SettleResult:
    """`BlockManager.settle_steps`: validate the report, then apply it.

    Completed steps: their blocks count as written; a defrag plan whose moves they carried
    commits (its table rewrites go into the open step, to be delivered with the next one).
    Failed steps: their plan aborts, the sequences they wrote are dropped (their K/V is
    missing; announced as dropped in the open step), and the prefix-cache hashes of the blocks
    they filled are forgotten."""
    done = _check_report(pool, completed_up_to, failed_from)
    committed: list[PlanId] = []
    aborted: list[PlanId] = []
    dropped: list[SeqId] = []
    pool.settled_step = done
    pool.unsettled = [r for r in pool.unsettled if r.step_id > done]
    if pool.host is not None:
        pool.host.release_holds(done)
    if pool.plan is not None and pool.plan.step_id <= done:
        committed.append(pool.plan.plan_id)
        _defrag.commit(pool)
    if failed_from is not None and failed_from > done:
        aborted, dropped = _fail(seqs, pool, failed_from)
    # the fetches of reported steps are over (pulled, or recomputed by the node): unpin
    _fetch.repay(pools, pool.pool_id, pool.settled_step)
    return SettleResult(pool.pool_id, StepId(pool.settled_step), tuple(committed), tuple(aborted), tuple(dropped))


def abandon_pool(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], pool: Pool) -> list[SeqId]:
    """`BlockManager.abandon_pool`: every sequence and unsettled step of the old scheduler
    dropped, the next step a reset. Returns the dropped ids."""
    if pool.plan is not None:
        _defrag.abort(pool)
    dropped = list(pool.seqs)
    for sid in dropped:
        seq = seqs.pop(sid)
        del pool.seqs[sid]
        for b in reversed(seq.block_table):
            pool.release_block(b)
        seq.release()
    host = pool.host
    if host is not None:
        # The old scheduler's unsettled and open steps never run: their host writes are void.
        dropped.extend(host.fail_from(pool.settled_step + 1, pool.step.step_id))
        for sid in list(host.swapped):
            host.drop_swapped(sid)
            dropped.append(sid)
        host.release_holds(pool.step.step_id)
    for registrations in [*(r.registrations for r in pool.unsettled), pool.step.registrations]:
        for b, block_hash in registrations:
            pool.unregister(b, block_hash)
    _fetch.repay(pools, pool.pool_id, pool.step.step_id)   # its fetches never run
    pool.unsettled = []
    pool.settled_step = pool.step.step_id - 1
    # The open step's own work belonged to the old scheduler too: the next step only resets.
    pool.step = StepWork(pool.step.step_id, reset=True, base_step_id=0)
    return dropped


def remove_pool(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], pool: Pool) -> list[SeqId]:
    """`BlockManager.remove_pool`: the pool and its sequences gone; returns their ids."""
    dropped = list(pool.seqs)
    for sid in dropped:
        del seqs[sid]
    if pool.host is not None:
        dropped.extend(pool.host.swapped)
    # its fetches never run now: the source blocks lent for them are unpinned (its own
    # loans go with it; a destination's pull from it fails and recomputes on the node)
    _fetch.repay(pools, pool.pool_id, pool.step.step_id)
    del pools[pool.pool_id]
    return dropped


__all__ = ["abandon_pool", "remove_pool", "build_output", "close_step", "drop_sequence", "settle_steps"]
