"""Defragmentation planning and the two-phase plan → copy → commit protocol.

Only *full, written* blocks move: their content is immutable (tokens are only ever appended
into a sequence's partial last block) and known to be in memory (the step that wrote them is
settled: its Forward completed), so the node can copy them while the sequences keep running on
the source blocks, and the switch to the destinations at commit is atomic from the tables'
point of view.

Lifecycle of a plan (at most one outstanding per pool):
  plan    destinations leave the free queue (counted as reserved; a cached destination is
          evicted), sources are pinned, one `CopyOp(kind="defrag")` per move is queued in
          the pool's open step, so the moves run in that step's Forward.
  commit  once that step is settled complete (`BlockManager.settle_steps`). Every table
          holding a moved source (all sharers, found by one pass over the pool's sequences)
          is rewritten in the next open step and its version bumped; ref count and hash
          identity pass to the destination; the source is freed.
  abort   (step failed, plan timed out) destinations go back to the free queue, sources are
          unpinned. A plan still in the open step takes its copies out of it (a tier move of
          that step, which the node runs before copies, may fill a released destination);
          copies a node already has are harmless: they only write blocks whose next owner
          writes in a later step, after that step's copies.
Sequences keep changing while a plan is outstanding: a source may gain sharers (fork,
prefix hit — the rewrite at commit covers them) or lose all of them (free). A pinned
source whose ref count reaches 0 is *held* by the plan (counted as reserved, its hash
dropped) instead of returning to the free queue, so it cannot be reused while the node
might still be copying from it; at commit or abort both it and its destination are
released.
"""

from __future__ import annotations

from block_manager.core.errors import FailedPrecondition, InvalidRequest, UnknownPlan, check_count
from block_manager.core.pool import PlanState, Pool
from block_manager.core.step_work import note_replaced
from block_manager.core.types import DefragKind, DefragPlan, DefragPolicy, PlanId, PoolId, SeqId


def contiguity_score(pool: Pool) -> float:
    """Fraction of adjacent logical block pairs (i, i+1), over all sequences of the pool,
    that are physically adjacent (id, id+1). 1.0 when there is no pair at all."""
    pairs = 0
    adjacent = 0
    for seq in pool.seqs.values():
        table = seq.block_table
        if len(table) < 2:
            continue
        pairs += len(table) - 1
        adjacent += sum(1 for a, b in zip(table, table[1:]) if b == a + 1)
    return adjacent / pairs if pairs else 1.0


def _unmovable(pool: Pool) -> set[int]:
    """Partial last blocks (still being written into) and blocks whose writing step is not
    settled (their K/V may not be in memory yet)."""
    bs = pool.block_size
    out = {s.block_table[-1] for s in pool.seqs.values() if s.num_tokens % bs}
    settled = pool.settled_step
    ws = pool.write_step
    for s in pool.seqs.values():
        for b in s.block_table:
            if ws[b] > settled:
                out.add(b)
    return out


def _available_ids(pool: Pool) -> list[int]:
    """Free or cached blocks (possible destinations), ascending."""
    return sorted([*pool.free_list, *pool.cached_list])


def plan_compaction(pool: Pool, max_moves: int | None) -> list[tuple[int, int]]:
    """Pair the highest movable used blocks with the lowest free ids below them, so the
    high-water mark falls toward the number of used blocks."""
    partial = _unmovable(pool)
    ref = pool.ref_cnt
    dests = _available_ids(pool)
    sources: list[int] = []
    for src in range(pool.num_blocks - 1, -1, -1):
        if max_moves is not None and len(sources) >= max_moves:
            break
        if len(sources) >= len(dests) or dests[len(sources)] >= src:
            break
        if ref[src] and src not in partial:
            sources.append(src)
    # Every chosen source lies above every chosen destination, so pairing both in
    # ascending order is valid and keeps a run of sources a run after the move.
    sources.reverse()
    return list(zip(sources, dests[: len(sources)]))


def plan_contiguity(pool: Pool, max_moves: int | None) -> list[tuple[int, int]]:
    """Re-place the full blocks of the least contiguous sequences into physical runs of
    free blocks (first fit), most broken sequence first. A sequence sharing a block with
    one already planned is skipped: its blocks are moving anyway."""
    bs = pool.block_size
    partial = _unmovable(pool)
    candidates: list[tuple[int, int, list[int]]] = []
    for order, seq in enumerate(pool.seqs.values()):
        full = seq.block_table[: seq.num_tokens // bs]
        if len(full) < 2:
            continue
        breaks = sum(1 for a, b in zip(full, full[1:]) if b != a + 1)
        if breaks:
            candidates.append((-breaks, order, full))
    if not candidates:
        return []
    candidates.sort(key=lambda c: (c[0], c[1]))
    runs: list[list[int]] = []  # [start, length] of free/cached id runs
    for b in _available_ids(pool):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    moving: set[int] = set()
    pairs: list[tuple[int, int]] = []
    for _, _, full in candidates:
        n = len(full)
        if max_moves is not None and len(pairs) + n > max_moves:
            continue
        if any(b in moving or b in partial for b in full):
            continue
        run = next((r for r in runs if r[1] >= n), None)
        if run is None:
            continue
        start = run[0]
        run[0] += n
        run[1] -= n
        pairs.extend((b, start + i) for i, b in enumerate(full))
        moving.update(full)
    return pairs


def reserve(pool: Pool, plan_id: PlanId, kind: DefragKind, pairs: list[tuple[int, int]]) -> PlanState:
    """Phase one: take destinations out of the queues, pin sources, queue the copies in the
    open step."""
    moves = []
    for src, dst in pairs:
        if dst in pool.free_list:
            pool.free_list.remove(dst)
        else:
            pool.cached_list.remove(dst)
            pool.drop_hash(dst)
            pool.evictions += 1
        pool.reserved[dst] = 1
        pool.num_reserved += 1
        pool.pinned[src] = 1
        moves.append(pool.add_copy_op(src, dst, "defrag"))
    state = PlanState(plan_id, kind, moves, pool.step.step_id)
    pool.plan = state
    pool.step.plan_id = plan_id
    return state


def make_plan(pool: Pool, plan_id: PlanId, kind: DefragKind, max_moves: int | None) -> DefragPlan | None:
    """`BlockManager.plan_defrag` with the plan's id: validated, planned and reserved (None:
    nothing to move)."""
    if kind not in ("compaction", "contiguity"):
        raise InvalidRequest(f"unknown defrag kind {kind!r}")
    if max_moves is not None:
        check_count("max_moves", max_moves, 1)
    if pool.plan is not None:
        raise FailedPrecondition(f"pool {pool.pool_id!r} already has outstanding plan {pool.plan.plan_id}")
    if pool.lent:
        return None   # blocks lent to another pool's fetch must stay put until it is reported
    pairs = plan_compaction(pool, max_moves) if kind == "compaction" else plan_contiguity(pool, max_moves)
    if not pairs:
        return None
    state = reserve(pool, plan_id, kind, pairs)
    return DefragPlan(plan_id, pool.pool_id, kind, tuple(state.moves), state.step_id)


def plan_pool(pools: dict[PoolId, Pool], plan_id: PlanId) -> Pool:
    """The pool whose outstanding plan is `plan_id`; `UnknownPlan` if none."""
    for pool in pools.values():
        if pool.plan is not None and pool.plan.plan_id == plan_id:
            return pool
    raise UnknownPlan(f"unknown defrag plan {plan_id!r}")


def _release_reserved(pool: Pool, b: int) -> None:
    pool.reserved[b] = 0
    pool.num_reserved -= 1
    pool.free_list.push_front(b)


def commit(pool: Pool) -> list[SeqId]:
    """Phase two: switch every holder of a moved block to its destination."""
    plan = pool.plan
    if plan is None:
        raise FailedPrecondition(f"pool {pool.pool_id!r} has no outstanding plan")
    if plan.step_id > pool.settled_step:
        raise FailedPrecondition(
            f"plan {plan.plan_id}: its moves ride in step {plan.step_id}, settled only up to {pool.settled_step}"
        )
    ref = pool.ref_cnt
    mapping: dict[int, int] = {}
    for op in plan.moves:
        src, dst = op.src, op.dst
        pool.pinned[src] = 0
        if ref[src] == 0:
            # Every holder went away while the plan was outstanding: nothing to move.
            _release_reserved(pool, src)
            _release_reserved(pool, dst)
            continue
        mapping[src] = dst
        pool.write_step[dst] = pool.write_step[src]
        ref[dst] = ref[src]
        ref[src] = 0
        pool.reserved[dst] = 0
        pool.num_reserved -= 1
        meta = pool.meta[src]
        if meta is not None:
            pool.meta[dst] = meta
            pool.meta[src] = None
            pool.prefix_index[meta.block_hash] = dst
        # Back of the free list: used only after every other free block (but before any
        # cached block is evicted), so the high-water mark stays down as long as it can.
        pool.free_list.push_back(src)
        pool.defrag_moves += 1
    changed: list[SeqId] = []
    for seq in pool.seqs.values():
        table = seq.block_table
        hit = False
        for i, b in enumerate(table):
            moved = mapping.get(b)
            if moved is not None:
                note_replaced(pool.step, seq, i)
                table[i] = moved
                hit = True
        if hit:
            seq.sync_last_block()
            seq.version = pool.new_version()
            # The rewrite reaches the node with the open step: if that step fails, the node
            # may keep the old table (whose blocks are free now), so the sequence is dropped.
            seq.last_step = pool.step.step_id
            changed.append(seq.seq_id)
    if plan.kind == "compaction":
        pool.compaction_plans += 1
    else:
        pool.contiguity_plans += 1
    pool.plan = None
    pool.last_defrag_step = pool.num_steps
    return changed


def abort(pool: Pool) -> None:
    """Roll back phase one: destinations and held sources return to the free queue."""
    plan = pool.plan
    if plan is None:
        raise FailedPrecondition(f"pool {pool.pool_id!r} has no outstanding plan")
    if plan.step_id == pool.step.step_id:
        # No node has its copies yet: they leave the open step with it. Left there, they would
        # run in that step after its tier moves, overwriting what a swap-in or onboard of this
        # very step moved into a destination released here.
        moves = {op.op_id for op in plan.moves}
        pool.step.copy_ops = [op for op in pool.step.copy_ops if op.op_id not in moves]
        pool.step.plan_id = None
    for op in plan.moves:
        pool.pinned[op.src] = 0
        if pool.ref_cnt[op.src] == 0:
            _release_reserved(pool, op.src)
        _release_reserved(pool, op.dst)
    pool.aborted_plans += 1
    pool.plan = None


def unsent_plan_blocks(pool: Pool) -> int:
    """Blocks `reclaim_unsent_plan` would return to the free queue."""
    plan = pool.plan
    if plan is None or plan.step_id != pool.step.step_id:
        return 0
    return sum(1 + (pool.ref_cnt[op.src] == 0) for op in plan.moves)


def reclaim_unsent_plan(pool: Pool) -> bool:
    """Abort a defrag plan still in the pool's open step (no node has its copies), because
    its reserved blocks are needed now; whether one was aborted. Why: a pool's open step
    closes only with token work (service/state.py), so a plan made as the pool's last
    running sequence finished holds its blocks until new work comes — and the work waiting
    (swap-ins, admissions) may need exactly those blocks: a livelock. Its copies leave
    the open step with it, so nothing later taken from its destinations is overwritten."""
    plan = pool.plan
    if plan is None or plan.step_id != pool.step.step_id:
        return False
    abort(pool)
    return True


def due(pool: Pool, policy: DefragPolicy) -> DefragKind | None:
    """The kind of defragmentation the policy asks for, if any would move a block.

    Cost O(num_blocks + total table length): call it every few steps, not per token.
    """
    if pool.plan is not None or pool.num_used == 0:
        return None
    ratio = pool.high_water_mark() / pool.num_used
    score = contiguity_score(pool)
    steps_due = (
        policy.every_n_steps is not None
        and pool.num_steps - pool.last_defrag_step >= policy.every_n_steps
    )
    want_compaction = ratio > 1.0 and (
        steps_due
        or (policy.max_high_water_ratio is not None and ratio > policy.max_high_water_ratio)
    )
    if want_compaction and plan_compaction(pool, 1):
        return "compaction"
    want_contiguity = score < 1.0 and (
        steps_due or (policy.min_contiguity is not None and score < policy.min_contiguity)
    )
    if want_contiguity and plan_contiguity(pool, None):
        return "contiguity"
    return None
