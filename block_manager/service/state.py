"""The block manager service's state machine: core `BlockManager` + node registry + the
pools' scheduler leases.

Every mutation — live RPC or journal replay — goes through `ServiceState.apply(op,
payload, now)`. Payloads are plain JSON-shaped dicts (what the journal stores), so a
recovery replays exactly the code path that produced the original answer; that is what
makes "snapshot + replay" reproduce the acknowledged state. `now` only feeds lease
deadlines, which are not durable (they restart at recovery), so replay stays deterministic.

`apply` validates a whole request before touching anything and raises a typed error
(core `CoreError` or `errors.ServiceError`) with the state unchanged; it returns
`Applied(result, mutated)`, and only mutated results are journaled.

The hot operation is `step` (one scheduler step: its request `StepInput` in `step_codec.py`,
its answer `StepAnswer` in `step_answer.py`): reports of earlier
Forwards, frees, late ids of earlier appends, admissions, already-written reports, swaps, forks
and appends, then the open step of
every pool the scheduler drives is closed and returned as that pool's `PoolStep`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from block_manager.core.errors import (
    CoreError,
    DoubleFree,
    InvalidRequest,
    NodeFenced,
    PoolLeased,
    StepsUnsettled,
    UnknownSequence,
)
from block_manager.core.fetch import score as fetch_score
from block_manager.core.fleet import PoolView
from block_manager.core.hashing import hash_prefix
from block_manager.core.leases import PoolLeases, check_scheduler_id
from block_manager.core.manager import DEFAULT_MAX_UNSETTLED_STEPS, MAX_POOL_BLOCKS, BlockManager
from block_manager.core.nodes import NodeRegistry, check_node_id
from block_manager.core.types import DefragKind, DefragPlan, DefragPolicy, PoolId, SeqId
from block_manager.service.disk_codec import decode_disk_seeds
from block_manager.service.errors import NotPlaced
from block_manager.service.state_codec import check_count, check_optional_str, plan_dict
from block_manager.service.step_answer import ItemError, PoolFree, SettledPool, StepAnswer, pool_step_dict
from block_manager.service.step_codec import Alloc, AppendColumns, Report, StepInput

SNAPSHOT_FORMAT = 2
DEFRAG_KINDS: tuple[DefragKind, ...] = ("compaction", "contiguity")


@dataclass(slots=True, frozen=True)
class StateConfig:
    """Knobs of the state machine (a subset of the server config)."""

    default_block_size: int = 16
    max_blocks: int = 1 << 20
    max_block_size: int = 4096
    prefetch_window: int = 4
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    lease_ttl_s: float = 10.0
    defrag_policy: DefragPolicy | None = None
    max_batch: int = 4096
    remembered_ids: int = 65536     # freed / fenced seq ids kept for precise errors
    scheduler_lease_ttl_s: float = 30.0
    max_unsettled_steps: int = DEFAULT_MAX_UNSETTLED_STEPS


@dataclass(slots=True, frozen=True)
class Applied:
    """An op's answer and whether it changed the state (only then is it journaled)."""

    result: dict[str, Any]
    mutated: bool


@dataclass(slots=True)
class _CheckedStep:
    """A step checked as a whole (nothing changed yet), with what applying it reuses."""

    step: StepInput
    sched: str
    pools: list[PoolId]          # every live pool it touches (leases checked)
    reports: list[Report]        # the reports that apply (pool alive, same epoch)
    gone: set[SeqId]             # frees of sequences dropped with their pool: done already
    not_placed: set[int]         # placed allocations no pool takes
    has_items: set[str]          # pools it has tokens, forks or swaps for


@dataclass(slots=True)
class _Candidate:
    """A pool a placed allocation may go to, ranked by `_place`."""

    pool_id: PoolId
    num_local_tokens: int        # its prefix cached on this pool (or filled by this step)
    num_fetchable_tokens: int    # beyond that, cached on `fetch_pool_id`
    num_free_blocks: int         # free or evictable
    cost: float                  # `fetch.score`: tokens to compute, fetched ones discounted
    fetch_pool_id: PoolId | None


def _defrag_args(p: dict[str, Any]) -> tuple[DefragKind, int | None]:
    """A defrag request's plan kind (default compaction) and move cap, checked."""
    kind = p.get("kind") or "compaction"
    if kind not in DEFRAG_KINDS:
        raise InvalidRequest(f"unknown defrag kind {kind!r}")
    max_moves = p.get("max_moves")
    if max_moves is not None:
        check_count("max_moves", max_moves, 1, 1 << 30)
    return kind, max_moves


class ServiceState:
    """Core + registry + the small bookkeeping the service adds (freed/fenced ids)."""

    def __init__(
        self,
        config: StateConfig,
        core: BlockManager | None = None,
        registry: NodeRegistry | None = None,
        leases: PoolLeases | None = None,
    ) -> None:
        self.config = config
        self.core = core or BlockManager(
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            defrag_policy=config.defrag_policy,
            max_unsettled_steps=config.max_unsettled_steps,
        )
        self.registry = registry or NodeRegistry(config.lease_ttl_s)
        self.leases = leases or PoolLeases(config.scheduler_lease_ttl_s)
        # Remembered so a late request gets FAILED_PRECONDITION (double free / fenced
        # node) instead of a bare NOT_FOUND; bounded, oldest forgotten first.
        self.freed_ids: OrderedDict[SeqId, None] = OrderedDict()
        self.fenced_ids: OrderedDict[SeqId, PoolId] = OrderedDict()
        self.failed_ids: OrderedDict[SeqId, PoolId] = OrderedDict()  # dropped: their step failed
        self._ops: dict[str, Callable[[dict[str, Any], float], Applied]] = {
            "register_node": self._register_node,
            "expire_node": self._expire_node,
            "step": self._step,
            "release_pool": self._release_pool,
            "grant_pools": self._grant_pools,
            "plan_defrag": self._plan_defrag,
            "trigger_defrag": self._trigger_defrag,
            "abort_defrag": self._abort_defrag,
            "drain_node": self._drain_node,
            "reset_prefix_cache": self._reset_prefix_cache,
        }

    # ---- the one mutation path ------------------------------------------------------
    def apply(self, op: str, payload: Mapping[str, Any], now: float) -> Applied:
        handler = self._ops.get(op)
        if handler is None:
            raise InvalidRequest(f"unknown operation {op!r}")
        if not isinstance(payload, Mapping):
            raise InvalidRequest("payload must be a mapping")
        try:
            return handler(dict(payload), now)
        except (KeyError, TypeError, ValueError) as exc:
            # A payload of the wrong shape can only come from a bug or a corrupt journal;
            # handlers validate before they mutate, so the state is unchanged.
            raise InvalidRequest(f"malformed {op} payload: {exc!r}") from exc

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self._ops)

    # ---- helpers --------------------------------------------------------------------
    def _remember(self, ids: OrderedDict, key: SeqId, value: Any) -> None:
        ids[key] = value
        ids.move_to_end(key)
        while len(ids) > self.config.remembered_ids:
            ids.popitem(last=False)

    def _forget(self, seq_id: SeqId) -> None:
        self.freed_ids.pop(seq_id, None)
        self.fenced_ids.pop(seq_id, None)
        self.failed_ids.pop(seq_id, None)

    def _check_pool_epochs(self, pool_epochs: Mapping[str, Any] | None) -> None:
        for pool_id, epoch in sorted((pool_epochs or {}).items()):
            self.registry.check_epoch(pool_id, epoch)

    def _missing_seq_error(self, seq_id: SeqId) -> CoreError:
        pool = self.fenced_ids.get(seq_id)
        if pool is not None:
            return NodeFenced(f"sequence {seq_id!r} was dropped when pool {pool!r} was fenced or handed over")
        pool = self.failed_ids.get(seq_id)
        if pool is not None:
            return DoubleFree(f"sequence {seq_id!r} was dropped: the Forward of a step that wrote it failed")
        if seq_id in self.freed_ids:
            return DoubleFree(f"sequence {seq_id!r} was already freed")
        return UnknownSequence(f"unknown sequence {seq_id!r}")

    def _drop_pool(self, pool_id: PoolId) -> list[SeqId]:
        self.leases.release(pool_id)
        if pool_id not in self.core.pool_ids:
            return []
        dropped = self.core.remove_pool(pool_id)
        for sid in dropped:
            self._remember(self.fenced_ids, sid, pool_id)
        return dropped

    def _pool_ids(self, pool_id: str | None) -> list[PoolId]:
        if pool_id is None:
            return list(self.core.pool_ids)
        self.registry.check_active(pool_id)
        return [PoolId(pool_id)]

    # ---- nodes ----------------------------------------------------------------------
    def _register_node(self, p: dict[str, Any], now: float) -> Applied:
        node_id = check_node_id(p["node_id"])
        num_blocks = check_count("num_blocks", p["num_blocks"], 1, min(self.config.max_blocks, MAX_POOL_BLOCKS))
        block_size = p["block_size"] or self.config.default_block_size
        block_size = check_count("block_size", block_size, 1, self.config.max_block_size)
        address = check_optional_str("address", p.get("address"), 256) or ""
        geometry = p.get("geometry") or {}
        if not isinstance(geometry, dict):
            raise InvalidRequest("geometry must be a mapping")
        host_num_blocks = check_count("host_num_blocks", p.get("host_num_blocks", 0), 0,
                                      MAX_POOL_BLOCKS)
        disk_num_blocks, disk_blocks = decode_disk_seeds(p, block_size, host_num_blocks)   # before any change
        dropped = self._drop_pool(node_id)
        lease = self.registry.register(node_id, num_blocks, block_size, geometry, address, now)
        self.core.add_pool(node_id, num_blocks, block_size, host_num_blocks, disk_num_blocks, disk_blocks)
        result = {
            "pool_id": node_id,
            "epoch": lease.epoch,
            "lease_ttl_s": lease.lease_ttl_s,
            "block_size": block_size,
            "num_blocks": num_blocks,
            "prefetch_window": self.config.prefetch_window,
            "dropped_seq_ids": dropped,
            "host_num_blocks": host_num_blocks,
            **({"disk_num_blocks": disk_num_blocks} if disk_num_blocks else {}),
        }
        return Applied(result, True)

    def _expire_node(self, p: dict[str, Any], now: float) -> Applied:
        node_id, epoch = p["node_id"], p["epoch"]
        if not self.registry.fence(node_id, epoch):
            return Applied({"fenced": False, "dropped_seq_ids": []}, False)
        dropped = self._drop_pool(PoolId(node_id))
        return Applied({"fenced": True, "dropped_seq_ids": dropped}, True)

    def _drain_node(self, p: dict[str, Any], now: float) -> Applied:
        node = self.registry.check_active(p["node_id"])
        draining = bool(p["draining"])
        self.registry.set_draining(node.node_id, draining)
        self.core.set_draining(node.node_id, draining)
        return Applied({"num_sequences": len(self.core.sequences(node.node_id))}, True)

    # ---- the scheduler step ---------------------------------------------------------
    def pools_of(self, step: StepInput, item_pools: set[PoolId] | None = None) -> list[PoolId]:
        """Every live pool the step touches (reports, allocations, the pools of the sequences
        it names), sorted; unknown pools and sequences are skipped (their items fail on their
        own). A fleet member's step neither counts its fetch sources (they lend read-only, their
        owner drives them) nor reports on pools it lost (moot: handed over with their sequences).
        `item_pools`: `_item_pools(step)` when the caller has it already."""
        live = set(self.core.pool_ids)
        pools: set[str] = {r.pool_id for r in step.reports if r.pool_id in live and self._report_owned(step, r)}
        pools.update(a.pool_id for a in step.allocs if a.pool_id in live)
        if not step.fleet:
            pools.update(src for a in step.allocs for src in a.fetch_sources if src in live)
        pools |= self._item_pools(step) if item_pools is None else item_pools
        if step.free_ids or step.late.seq_ids:
            pools |= self.core.pools_of([*step.free_ids, *step.late.seq_ids])
        return sorted(PoolId(p) for p in pools)

    def _item_pools(self, step: StepInput) -> set[PoolId]:
        """The pools of the existing sequences a step's items and swaps name."""
        return self.core.pools_of([*self._item_seq_ids(step), *step.swap_ids])

    def _swap(self, key: str, ids: list[SeqId], errors: list[ItemError]) -> list[SeqId]:
        """Swap-outs or swap-ins of a Step: together (forks share host blocks), else one by
        one; a failed item changes nothing and is reported (section `key`)."""
        if not ids:
            return []
        call = self.core.swap_out if key == "swap_out" else self.core.swap_in
        try:
            call(ids)
            return ids
        except CoreError:
            pass
        done: list[SeqId] = []
        for i, sid in enumerate(ids):
            try:
                call([sid])
                done.append(sid)
            except CoreError as exc:
                errors.append(ItemError.of(key, i, exc))
        return done

    @staticmethod
    def _item_seq_ids(step: StepInput) -> list[SeqId]:
        """The existing sequences a step's items name (forks, appends, already-written)."""
        return [*(parent for parent, _ in step.forks), *step.appends.seq_ids, *step.written.seq_ids]

    def _resolve_late(self, late: AppendColumns, dropped: set[SeqId], errors: list[ItemError]) -> None:
        """The late ids of earlier appends (before every section that may touch their
        sequences). Ids for a sequence this Step's reports just dropped are moot: skipped."""
        if not late:
            return
        keep = [i for i, sid in enumerate(late.seq_ids) if SeqId(sid) not in dropped]
        starts = [0]
        for n in late.counts:
            starts.append(starts[-1] + n)
        ids = late.token_ids or []
        failures = self.core.resolve_late(
            [SeqId(late.seq_ids[i]) for i in keep], [late.counts[i] for i in keep],
            [t for i in keep for t in ids[starts[i] : starts[i + 1]]],
        )
        for j, err in failures:
            i = keep[j]
            if isinstance(err, UnknownSequence):
                err = self._missing_seq_error(SeqId(late.seq_ids[i]))
            errors.append(ItemError.of("late", i, err))

    def _step(self, p: dict[str, Any], now: float) -> Applied:
        check_scheduler_id(p.get("scheduler_id"))
        return self.apply_step(StepInput.from_json(p, self.config.max_batch), now)

    def apply_step(self, step: StepInput, now: float) -> Applied:
        """The `step` op on an already decoded request, its answer in the JSON form: what
        `apply("step", payload)` does after decoding."""
        answer, mutated = self.step_answer(step, now)
        return Applied(answer.to_json(), mutated)

    def step_answer(self, step: StepInput, now: float) -> tuple[StepAnswer, bool]:
        """The `step` op on an already decoded request (`StepInput.from_pb` on the live path and
        for a packed journal record, `from_json` for a JSON one): the typed answer, and whether
        anything changed."""
        sched = check_scheduler_id(step.scheduler_id)
        try:
            checked = self._check_step(step, sched, now)   # fails the request as a whole: nothing changed
            return self._apply_step(checked, now)
        except (KeyError, TypeError, ValueError) as exc:   # as `apply` maps them
            raise InvalidRequest(f"malformed step payload: {exc!r}") from exc

    def _check_step(self, step: StepInput, sched: str, now: float) -> _CheckedStep:
        """Everything that fails a step as a whole, checked before anything changes; placed
        allocations get their pool (`_place`) here, which only writes into `step`."""
        core = self.core
        self._check_pool_epochs(step.pool_epochs)
        not_placed = self._place(step, sched, now)
        item_pools = self._item_pools(step)   # (the pools a Step names: one pass over its ids)
        pools = self.pools_of(step, item_pools)
        for pid in pools:
            if step.fleet:
                self._check_owned(pid, sched, now)
            else:
                self.leases.check(pid, sched, now)
        reports = [r for r in step.reports if self._report_applies(r) and self._report_owned(step, r)]
        to_drop: set[SeqId] = set()
        for r in reports:
            to_drop |= self._check_report(r)
        # A free of a sequence dropped with its pool (fenced, handed over) is done already: the
        # scheduler cannot know of a fencing before it frees, so it is accepted, not refused.
        gone = {SeqId(s) for s in step.free_ids if SeqId(s) in self.fenced_ids and not core.has_sequence(SeqId(s))}
        for sid in step.free_ids:
            if SeqId(sid) not in to_drop and SeqId(sid) not in gone and not core.has_sequence(SeqId(sid)):
                raise self._missing_seq_error(SeqId(sid))
        has_items: set[str] = {a.pool_id for a in step.allocs}
        has_items |= item_pools
        settled_after: dict[str, int] = {r.pool_id: r.failed_from or r.completed_up_to for r in reports}
        for pool in sorted(has_items & set(pools)):
            pending = [s for s in core.unsettled_step_ids(PoolId(pool)) if s > settled_after.get(pool, 0)]
            if len(pending) >= core.max_unsettled_steps:
                raise StepsUnsettled(
                    f"pool {pool!r}: steps {pending} await their Forward report; report them in this step"
                )
        self._check_free_pending(step.free_ids, to_drop | gone)
        return _CheckedStep(step, sched, pools, reports, gone, not_placed, has_items)

    def _apply_step(self, c: _CheckedStep, now: float) -> tuple[StepAnswer, bool]:
        """Apply a checked step: reports, frees, late ids, allocations, written reports, swaps,
        forks, appends (each item failing alone), then close the step of every pool with
        tokens; the answer, and whether anything changed (only then is it journaled)."""
        core, step = self.core, c.step
        new_leases = any(self.leases.get(pid) is None for pid in c.pools)
        settled_before: dict[str, int] = {r.pool_id: core.settled_step_id(r.pool_id) for r in c.reports}
        lease_epochs: dict[str, int] = {pid: self.leases.acquire(pid, c.sched, now) for pid in c.pools}
        settled = [self._settle(r) for r in c.reports]
        dropped = {sid for s in settled for sid in s.dropped_seq_ids}
        frees = [SeqId(s) for s in step.free_ids if SeqId(s) not in dropped and SeqId(s) not in c.gone]
        if frees:
            core.free(frees)
            for sid in frees:
                self._remember(self.freed_ids, sid, None)
        for sid in sorted(c.gone):   # freed now as far as the scheduler is concerned: a second free is a double free
            self._forget(sid)
            self._remember(self.freed_ids, sid, None)
        errors: list[ItemError] = []
        self._resolve_late(step.late, dropped, errors)
        alloc_cached, alloc_tokens = self._allocate(step, errors, c.not_placed)
        self._append(step.written, "written", errors, already_written=True)
        # after the written reports: a swapped-out sequence's true length is known by then
        swapped_out = self._swap("swap_out", [s for s in step.swap_out if s not in dropped], errors)
        swapped_in = self._swap("swap_in", [s for s in step.swap_in if s not in dropped], errors)
        self._fork(step, errors)
        append_tokens = self._append(step.appends, "append", errors, already_written=False)
        # a fetch source's grant rides in its own step, closed with this one (prefix fetch); a
        # fleet member closes only the steps of pools it owns: its own lenders, and those lending
        # to another member's fetch (the grant waits in the open step of its owner's pool)
        lenders = {src for a in step.allocs for src in a.fetch_sources}
        if step.fleet:
            lenders = {pid for pid in lenders if self._holds(pid, c.sched)} | set(self.leases.held_by(c.sched))
        has_items = c.has_items | {pid for pid in lenders if pid in core.pool_ids and core.is_lending(PoolId(pid))}
        steps = self._close_steps(has_items)
        if step.release:
            self._release_held(c.sched)
            lease_epochs = {}
        # a step whose every item failed and that settled, freed, closed and took nothing is
        # answered but not journaled (replaying it would change nothing)
        mutated = bool(
            new_leases or frees or swapped_out or swapped_in or c.gone or steps or step.release
            or len(errors) < step.num_items
            or any(s.settled_step != settled_before[s.pool_id] or s.committed_plan_ids or s.aborted_plan_ids
                   or s.dropped_seq_ids for s in settled)
        )
        answer = StepAnswer(
            steps=steps,
            settled=settled,
            errors=errors,
            alloc_num_cached_tokens=alloc_cached,
            alloc_num_tokens=alloc_tokens,
            append_num_tokens=append_tokens,
            lease_epochs=lease_epochs,
            pool_free=[self._pool_free(pid) for pid in sorted(core.pool_ids)],
            swapped_out=swapped_out,
            swapped_in=[(s, core.get_sequence(s).num_tokens) for s in swapped_in],
            alloc_pool_ids=[a.pool_id if tokens else "" for a, tokens in zip(step.allocs, alloc_tokens)],
        )
        return answer, mutated

    def _close_steps(self, has_items: set[str]) -> list[dict[str, Any]]:
        """Close the open step of every pool this step has tokens (or forks) for.

        Only a step whose Forward the scheduler is about to run hands out a PoolStep: a Step
        of frees or reports alone closes nothing, so no PoolStep (a defrag plan's copies, say)
        can come back from a call whose caller has no Forward to carry it in. What waits in
        the open step rides in the pool's next step with tokens."""
        core = self.core
        steps = []
        for pid in sorted(has_items):
            if pid in core.pool_ids and core.can_close_step(PoolId(pid)):
                out = core.close_step(PoolId(pid))
                if out is not None:
                    steps.append(pool_step_dict(out, self.registry.get(pid).epoch, self._address_of))
        return steps

    def _release_held(self, sched: str) -> None:
        """Give up every lease `sched` holds, dropping the sequences left on those pools."""
        core = self.core
        held = [pid for pid, lease in self.leases.holders().items() if lease.scheduler_id == sched]
        for pid in sorted(held):
            if pid in core.pool_ids and core.sequences(pid):
                for sid in core.abandon_pool(pid):
                    self._remember(self.fenced_ids, sid, pid)
            self.leases.release(pid)

    def _pool_free(self, pool_id: PoolId) -> PoolFree:
        """A pool's room after the step; host blocks free or evictable for a pool with a host tier."""
        num_free, num_usable = self.core.free_blocks(pool_id)
        m = self.core.host_metrics(pool_id)
        return PoolFree(pool_id, num_free, num_usable,
                        None if m is None else m.num_free_blocks + m.num_cached_blocks)

    def _address_of(self, pool_id: str) -> str:
        """A pool's node address (a fetch source's, for the destination's pull)."""
        try:
            return self.registry.get(pool_id).address
        except CoreError:
            return ""

    def _report_applies(self, r: Report) -> bool:
        """A report on a pool that is gone or re-registered since is moot (that incarnation's
        sequences were dropped with it)."""
        if r.pool_id not in self.core.pool_ids:
            return False
        return r.epoch == 0 or r.epoch == self.registry.get(r.pool_id).epoch

    def _check_report(self, r: Report) -> set[SeqId]:
        """Validate a report without applying it; the sequences it would drop."""
        core = self.core
        last_closed = core.open_step_id(r.pool_id) - 1
        done = max(r.completed_up_to, core.settled_step_id(r.pool_id))
        if r.completed_up_to > last_closed:
            raise StepsUnsettled(f"pool {r.pool_id!r}: step {r.completed_up_to} was never handed out")
        if r.failed_from is None:
            return set()
        if r.failed_from != done + 1 or r.failed_from > last_closed:
            raise InvalidRequest(
                f"pool {r.pool_id!r}: failed_from {r.failed_from} must be the first unsettled step "
                f"(settled up to {done}, last handed out {last_closed})"
            )
        return set(core.writers_since(r.pool_id, r.failed_from))

    def _check_free_pending(self, free_ids: list[SeqId], to_drop: set[SeqId]) -> None:
        """A sequence with tokens to write in its open step cannot be freed (core contract);
        checked here too so the request fails before anything changed."""
        for sid in free_ids:
            if SeqId(sid) not in to_drop:
                self.core.check_can_free(SeqId(sid))

    def _settle(self, r: Report) -> SettledPool:
        res = self.core.settle_steps(r.pool_id, r.completed_up_to, r.failed_from)
        for sid in res.dropped_seq_ids:
            self._remember(self.failed_ids, sid, r.pool_id)
        return SettledPool(r.pool_id, res.settled_step, list(res.committed_plan_ids), list(res.aborted_plan_ids),
                           list(res.dropped_seq_ids))

    def _place(self, step: StepInput, sched: str, now: float) -> set[int]:
        """Pick a pool for every placed allocation (deterministic: a replay picks the same):
        among the step's candidates that admit sequences and that `sched` may drive, the
        longest cached prefix, then the most free-or-evictable blocks after what this step
        already gave each pool, then the pool id. With an admission budget, allocations are
        placed in order while it lasts, each computing at most what is left (its `num_compute`
        is set). Returns the indexes of those no pool takes (`NotPlaced`; `pool_id` stays "")."""
        placed = [(i, a) for i, a in enumerate(step.allocs) if a.place]
        if not placed:
            return set()
        usable, sources = self._placement_pools(step, sched, now)
        budget = step.placement.admit_budget
        taken: dict[str, int] = {}
        filling: dict[str, set[bytes]] = {}   # pool -> hashes of the blocks this step's admissions fill
        refused: set[int] = set()
        for i, a in placed:
            if not usable or (step.placement.admit_budget and budget <= 0):
                refused.add(i)
                continue
            length = len(a.token_ids) if a.token_ids else (a.num_tokens or 0)
            hashes: dict[int, list[bytes]] = {}
            ranked = self._candidates(a, length, usable, sources, filling, hashes)
            if not ranked:
                refused.add(i)
                continue

            def fits(c: _Candidate, length: int = length) -> bool:
                """Room for the blocks beyond its local prefix (its local hits may be cached
                blocks counted as free: not counted as room)."""
                bs = self.registry.get(c.pool_id).block_size
                local = c.num_local_tokens // bs
                return -(-length // bs) - local <= c.num_free_blocks - local - taken.get(c.pool_id, 0)

            # a pool with room first (a busy pool holding the prefix lends it to one that has
            # room, instead of the request queueing for it), then the cost, load and id
            best = min(ranked, key=lambda c: (not fits(c), c.cost, taken.get(c.pool_id, 0) - c.num_free_blocks,
                                               c.pool_id))
            fetchable = best.num_fetchable_tokens
            a.fetch_sources = [best.fetch_pool_id] if best.fetch_pool_id is not None and fetchable else []
            cached = best.num_local_tokens + fetchable
            if step.placement.admit_budget:
                a.num_compute = min(budget, a.num_compute or budget)
                budget -= max(1, min(a.num_compute, length - cached))
            pool = a.pool_id = best.pool_id
            bs = self.registry.get(pool).block_size
            # fetched blocks are fresh blocks of the destination: only local ones are not taken
            taken[pool] = taken.get(pool, 0) + -(-(length - best.num_local_tokens) // bs)
            if a.token_ids and self.core.enable_prefix_caching:
                computed = cached + (a.num_compute or length)
                if bs not in hashes:
                    hashes[bs] = hash_prefix(a.token_ids, bs, a.salt)
                filling.setdefault(pool, set()).update(hashes[bs][: computed // bs])
        return refused

    def _placement_pools(self, step: StepInput, sched: str, now: float) -> tuple[set[str], list[PoolId]]:
        """The pools placed allocations may go to (the step's candidates, else every live pool,
        neither fenced, draining nor driven by another scheduler), and those that may lend
        prefix blocks (draining ones too: docs/prefix_fetch.md)."""
        live = set(self.core.pool_ids)
        candidates = set(step.placement.pool_ids) & live if step.placement.pool_ids else live
        if step.fleet:
            return self._fleet_placement_pools(candidates, live, sched)
        usable: set[str] = set()
        sources: list[PoolId] = []
        for pid in candidates:
            node = self.registry.get(pid)
            if not node.fenced and self.leases.blocked(pid, sched, now) is None:
                sources.append(PoolId(pid))
                if not node.draining:
                    usable.add(pid)
        return usable, sources

    def _fleet_placement_pools(self, candidates: AbstractSet[str], live: AbstractSet[str], sched: str
                               ) -> tuple[set[str], list[PoolId]]:
        """A fleet member's placement: only the candidates it owns take admissions; any pool
        some scheduler owns may lend (read-only: its blocks are pinned by a loan, its grant
        waits in its open step for its owner's next Step; a pool nobody drives could not
        deliver the grant)."""
        usable: set[str] = set()
        sources: list[PoolId] = []
        for pid in sorted(live):
            node = self.registry.get(pid)
            if node.fenced or self.leases.get(pid) is None:
                continue
            sources.append(PoolId(pid))
            if pid in candidates and not node.draining and self._holds(pid, sched):
                usable.add(pid)
        return usable, sources

    def _holds(self, pool_id: str, sched: str) -> bool:
        lease = self.leases.get(pool_id)
        return lease is not None and lease.scheduler_id == sched

    def _check_owned(self, pool_id: str, sched: str, now: float) -> None:
        """A fleet member drives only pools the fleet gave it (`PoolLeased` otherwise, also for
        a pool nobody holds: the fleet assigns it, a member's step never takes it)."""
        if self._holds(pool_id, sched):
            return
        self.leases.check(pool_id, sched, now)
        raise PoolLeased(f"pool {pool_id!r} is not owned by fleet member {sched[:64]!r} (not assigned to it)")

    def _report_owned(self, step: StepInput, r: Report) -> bool:
        """A fleet member's report on a pool it no longer holds is moot (the pool was handed
        over: its sequences there were dropped, its steps counted as failed)."""
        return not step.fleet or self._holds(r.pool_id, step.scheduler_id)

    def _candidates(self, a: Alloc, length: int, usable: set[str], sources: list[PoolId],
                    filling: dict[str, set[bytes]], hashes: dict[int, list[bytes]]) -> list[_Candidate]:
        """Allocation `a` on every usable pool: its cached prefix there and its cost."""
        core = self.core
        if not a.token_ids:
            return [_Candidate(PoolId(pid), 0, 0, core.free_blocks(PoolId(pid))[1], float(length), None)
                    for pid in usable]
        # the fetch cost model (block_manager/core/fetch.py): tokens to recompute plus
        # fetched tokens / FETCH_SPEEDUP, then the load this step already put on the pool
        ranked = [_Candidate(e.pool_id, e.num_cached_tokens, e.num_fetchable_tokens, e.num_free_blocks,
                             fetch_score(length, e.num_cached_tokens, e.num_fetchable_tokens), e.fetch_pool_id)
                  for e in core.route(a.token_ids, a.salt, fetch_sources=sources) if e.pool_id in usable]
        if filling and core.enable_prefix_caching:
            ranked = [self._with_step_prefix(c, a.token_ids, a.salt, length, filling, hashes) for c in ranked]
        return ranked

    def _with_step_prefix(self, c: _Candidate, token_ids: list[int], salt: str | None, length: int,
                          filling: dict[str, set[bytes]], hashes: dict[int, list[bytes]]) -> _Candidate:
        """Candidate `c` of an admission, its local prefix extended by the blocks earlier
        admissions of this step fill on that pool: the core shares those in this very step
        (`BlockManager._prefix_hits`), so twenty prompts with one system prompt cost the prefix
        once, and the step's token budget is charged for what is really computed."""
        mine = filling.get(c.pool_id)
        if not mine:
            return c
        bs = self.registry.get(c.pool_id).block_size
        if bs not in hashes:
            hashes[bs] = hash_prefix(token_ids, bs, salt)
        n = 0
        for h in hashes[bs][: (length - 1) // bs]:   # one token is always computed
            if h not in mine:
                break
            n += 1
        if n * bs <= c.num_local_tokens:
            return c
        fetchable = max(0, c.num_local_tokens + c.num_fetchable_tokens - n * bs)
        return _Candidate(c.pool_id, n * bs, fetchable, c.num_free_blocks, fetch_score(length, n * bs, fetchable),
                          c.fetch_pool_id if fetchable else None)

    def _allocate(
        self, step: StepInput, errors: list[ItemError], not_placed: set[int]
    ) -> tuple[list[int], list[int]]:
        cached: list[int] = []
        tokens: list[int] = []
        for i, a in enumerate(step.allocs):
            try:
                if i in not_placed:
                    raise NotPlaced(f"allocation {a.seq_id!r}: no candidate pool takes it in this step")
                self.registry.check_active(a.pool_id)
                res = self.core.allocate(
                    SeqId(a.seq_id), PoolId(a.pool_id), a.token_ids, num_tokens=a.num_tokens, salt=a.salt,
                    num_compute=a.num_compute, fetch_sources=[PoolId(p) for p in a.fetch_sources],
                )
            except CoreError as exc:
                errors.append(ItemError.of("alloc", i, exc))
                cached.append(0)
                tokens.append(0)
                continue
            self._forget(SeqId(a.seq_id))
            cached.append(res.num_cached_tokens)
            tokens.append(res.num_cached_tokens + len(res.slot_mapping))
        return cached, tokens

    def _fork(self, step: StepInput, errors: list[ItemError]) -> None:
        for i, (parent, children) in enumerate(step.forks):
            try:
                try:
                    self.core.get_sequence(SeqId(parent))
                except UnknownSequence:
                    raise self._missing_seq_error(SeqId(parent)) from None
                self.core.fork(SeqId(parent), [SeqId(c) for c in children])
            except CoreError as exc:
                errors.append(ItemError.of("fork", i, exc))
                continue
            for c in children:
                self._forget(SeqId(c))

    def _append(
        self, items: AppendColumns, section: str, errors: list[ItemError], *, already_written: bool,
    ) -> list[int]:
        if not items:
            return []
        out = self.core.append_tokens(items.seq_ids, items.counts, items.token_ids,
                                      already_written=already_written, num_late=items.num_late)
        for i, err in out.failures:
            if isinstance(err, UnknownSequence):
                err = self._missing_seq_error(SeqId(items.seq_ids[i]))
            errors.append(ItemError.of(section, i, err))
        return out.num_tokens

    def _release_pool(self, p: dict[str, Any], now: float) -> Applied:
        """Hand a pool over: the lapsed holder's sequences are dropped (their scheduler is
        gone or fenced off), its unsettled steps count as failed, its lease ends."""
        pool_id = PoolId(p["pool_id"])
        lease = self.leases.get(pool_id)
        if lease is None or lease.scheduler_id != p["scheduler_id"] or lease.epoch != p["epoch"]:
            return Applied({"released": False, "dropped_seq_ids": []}, False)
        self.leases.release(pool_id)
        dropped: list[SeqId] = []
        if pool_id in self.core.pool_ids:
            dropped = self.core.abandon_pool(pool_id)
            for sid in dropped:
                self._remember(self.fenced_ids, sid, pool_id)
        return Applied({"released": True, "dropped_seq_ids": dropped}, True)

    def _grant_pools(self, p: dict[str, Any], now: float) -> Applied:
        """Fleet assignment (core/fleet.py): each (pool, scheduler) takes the pool's lease if the
        pool is live, admits sequences and has no lease now (a grant never takes a held pool:
        never two owners); the others are skipped. Journaled: ownership survives a restart."""
        grants = p["grants"]
        if not isinstance(grants, list) or len(grants) > self.config.max_batch:
            raise InvalidRequest(f"grants must be a list of at most {self.config.max_batch} entries")
        checked = [(PoolId(check_node_id(pid)), check_scheduler_id(sid)) for pid, sid in grants]
        granted: list[list[Any]] = []
        for pid, sid in checked:
            if pid not in self.core.pool_ids or self.leases.get(pid) is not None:
                continue
            node = self.registry.get(pid)
            if node.fenced or node.draining:
                continue
            granted.append([pid, sid, self.leases.acquire(pid, sid, now)])
        return Applied({"granted": granted}, bool(granted))

    def fleet_views(self, now: float) -> list[PoolView]:
        """Every pool as the fleet's rounds see it (core/fleet.py)."""
        out = []
        for pid in sorted(self.core.pool_ids):
            node = self.registry.get(pid)
            lease = self.leases.get(pid)
            out.append(PoolView(
                pid, node.num_blocks, not node.fenced and not node.draining,
                None if lease is None else lease.scheduler_id, 0 if lease is None else lease.epoch,
                lease is not None and lease.deadline <= now,
            ))
        return out

    # ---- defragmentation ------------------------------------------------------------
    def _plan_defrag(self, p: dict[str, Any], now: float) -> Applied:
        pool_id = p["pool_id"]
        self.registry.check_active(pool_id)
        kind, max_moves = _defrag_args(p)
        plan = self.core.plan_defrag(PoolId(pool_id), kind, max_moves)
        return Applied({"plan": plan_dict(plan) if plan else None}, plan is not None)

    def _trigger_defrag(self, p: dict[str, Any], now: float) -> Applied:
        """The admin trigger as ONE op: plan `kind` for one pool, or for every pool without an
        outstanding plan. One op means one journal record and one recorded answer under the
        admin's request id, so a resend gets exactly the plans the first call made (planning
        per pool under derived ids lost the answer: the pools that got a plan are busy by the
        time the resend picks its pools)."""
        pool_id = check_optional_str("pool_id", p.get("pool_id"), 128)
        kind, max_moves = _defrag_args(p)
        if pool_id:
            self.registry.check_active(pool_id)
            plan = self.core.plan_defrag(PoolId(pool_id), kind, max_moves)
            plans = [plan] if plan is not None else []
        else:
            plans = []
            for pid in self.core.pool_ids:
                if self.core.get_defrag_plan(pid) is not None:
                    continue
                try:
                    plan = self.core.plan_defrag(pid, kind, max_moves)
                except CoreError:
                    continue   # this pool cannot take a plan now (it changed nothing); the others can
                if plan is not None:
                    plans.append(plan)
        return Applied({"plans": [plan_dict(plan) for plan in plans]}, bool(plans))

    def _abort_defrag(self, p: dict[str, Any], now: float) -> Applied:
        self.core.abort_defrag(p["plan_id"])
        return Applied({}, True)

    def _reset_prefix_cache(self, p: dict[str, Any], now: float) -> Applied:
        pool_ids = self._pool_ids(check_optional_str("pool_id", p.get("pool_id"), 128))
        # Blocks in use lose their hashes too (not counted in the answer): that is a change.
        hashed = sum(self.core.num_prefix_hashes(pid) for pid in pool_ids)
        num = sum(self.core.reset_prefix_cache(pid) for pid in pool_ids)
        return Applied({"num_blocks_reset": num}, num > 0 or hashed > 0)

    # ---- queries --------------------------------------------------------------------
    def outstanding_plans(self) -> list[DefragPlan]:
        plans = (self.core.get_defrag_plan(pid) for pid in self.core.pool_ids)
        return [plan for plan in plans if plan is not None]

    def fsck(self) -> list[str]:
        problems = list(self.core.fsck())
        active = {n.node_id for n in self.registry.nodes() if n.active}
        pools = set(self.core.pool_ids)
        for pid in sorted(active - pools):
            problems.append(f"node {pid!r} is active but has no pool")
        for pid in sorted(pools - active):
            problems.append(f"pool {pid!r} has no active node")
        return problems

    # ---- snapshots ------------------------------------------------------------------
    def to_snapshot(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "core": self.core.to_snapshot(),
            "registry": self.registry.to_snapshot(),
            "leases": self.leases.to_snapshot(),
            "freed_ids": list(self.freed_ids),
            "fenced_ids": [[sid, pid] for sid, pid in self.fenced_ids.items()],
            "failed_ids": [[sid, pid] for sid, pid in self.failed_ids.items()],
        }

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any], config: StateConfig, now: float) -> ServiceState:
        try:
            if data["format"] != SNAPSHOT_FORMAT:
                raise InvalidRequest(f"unsupported service snapshot format {data['format']!r}")
            core = BlockManager.from_snapshot(data["core"])
            core.max_unsettled_steps = config.max_unsettled_steps
            registry = NodeRegistry.from_snapshot(data["registry"], now, config.lease_ttl_s)
            leases = PoolLeases.from_snapshot(data["leases"], config.scheduler_lease_ttl_s, now)
            state = cls(config, core, registry, leases)
            for sid in data["freed_ids"]:
                state.freed_ids[SeqId(sid)] = None
            for sid, pid in data["fenced_ids"]:
                state.fenced_ids[SeqId(sid)] = PoolId(pid)
            for sid, pid in data["failed_ids"]:
                state.failed_ids[SeqId(sid)] = PoolId(pid)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed service snapshot: {exc!r}") from exc
        return state


__all__ = ["DEFRAG_KINDS", "Applied", "ServiceState", "StateConfig"]
