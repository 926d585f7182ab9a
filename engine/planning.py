"""Planning one step into one block-manager Step, and what the Step's answer means.

The plan, under a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
running sequences first (a decode token each, or the next chunk of a long prompt: chunked
prefill), forks of `n > 1` requests whose shared prompt is computed, then new requests in
arrival order as placed allocations (the block manager picks each one's node inside the same
Step, within the budget). With a step in flight (`engine.pipeline`), a sequence's plan starts
where that step leaves it: a speculative decode token (its id sent later), the next prompt
chunk, or nothing yet.

The answer, item by item, by the failure table (`engine.failure_policy`): an admission that
does not fit waits; an append that does not fit preempts the most recently admitted running
sequence without work (possibly itself); a refused fork lets the parent go on alone. Mixed
into `LLMEngine`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from block_manager.client import ItemFailure, StepResult
from engine.errors import EngineFailure
from engine.failure_policy import Action, Item, action_for
from engine.pipeline import PLACEHOLDER, InFlight, Work
from engine.sequence import Request, SeqStatus, Sequence
from pagedkv.logging import get_logger

# Admission sizes that keep every Step inside what the block manager accepts (4096 items and
# 64 MiB by default) without resending the whole queue every step.
MAX_ADMISSIONS_PER_STEP = 256
ADMIT_IDS_PER_BUDGET_TOKEN = 8    # prompt token ids sent for admission per token of budget
MAX_STEP_TOKEN_IDS = 1 << 20      # admitted prompt token ids one Step carries (one admission at least)
log = get_logger("engine.planning")


@dataclass(slots=True)
class StepPlan:
    """What one Step asks for: appends (as the work they become), forks with their children's
    new ids, admissions with their new ids."""

    appends: list[Work] = field(default_factory=list)
    children_of: dict[Sequence, list[tuple[Sequence, str]]] = field(default_factory=dict)
    admitted: list[tuple[Sequence, str]] = field(default_factory=list)


class StepPlanner:
    """The engine's step planning and the reading of the Step's answer."""

    def _plan_running(self, batch: Any, budget: int, flight: InFlight | None) -> tuple[StepPlan, int]:
        """Appends and forks of the running sequences; the budget left."""
        plan = StepPlan()
        forks: list[Sequence] = []
        for seq in self.running:
            if budget <= 0:
                break
            prev = flight.by_seq.get(seq) if flight is not None else None
            if prev is not None and prev.seq_id == seq.seq_id:
                w = self._plan_after(seq, prev, budget)
            elif seq.fork_parent and seq.num_computed == seq.prefill_target:
                forks.append(seq)
                continue
            else:
                start = seq.num_computed
                n = min(len(seq.token_ids) - start, seq.prefill_target - start
                        if start < seq.prefill_target else 1, budget)
                w = None if n <= 0 else Work(seq, seq.seq_id or "", seq.token_ids[start : start + n], start + n,
                                             start + n >= seq.num_prompt)
            if w is None:
                continue
            batch.append(w.seq_id, w.token_ids, num_late=1 if w.speculative else 0)
            plan.appends.append(w)
            budget -= len(w.token_ids)
        for parent in forks:
            kids = [(s, s.new_admission_id()) for s in parent.request.seqs if s.status is SeqStatus.FORKING]
            batch.fork(parent.seq_id, [kid_id for _, kid_id in kids])
            plan.children_of[parent] = kids
            # each computes the last prompt token and samples
            batch.append(parent.seq_id, [parent.token_ids[-1]])
            for _, kid_id in kids:
                batch.append(kid_id, [parent.token_ids[-1]])
            budget -= 1 + len(kids)
        return plan, budget

    def _plan_after(self, seq: Sequence, prev: Work, budget: int) -> Work | None:
        """The work of a sequence whose previous step is still running (`prev`): its next
        prompt chunk, a speculative decode token (when it cannot stop by length at `prev`), or
        nothing this step. The speculative token's id comes later: inside its partial last
        block the client defers the append, else the block manager takes it with a late id."""
        start = prev.context_len
        if not prev.sample:
            if start >= seq.prefill_target:
                return None          # a fork parent: it forks once this step is reported
            n = min(seq.prefill_target - start, budget)
            return Work(seq, prev.seq_id, seq.token_ids[start : start + n], start + n, start + n >= seq.num_prompt)
        p = seq.request.params
        if seq.num_output_tokens + 1 >= p.max_tokens or start + 1 >= self.max_model_len:
            return None              # its token in flight is its last
        if self.client.tracker.get(prev.seq_id) is None:
            self.stats.speculation_waits += 1
            return None              # not mirrored (its Step's outcome was unknown): wait for its id
        self.stats.speculative_tokens += 1
        return Work(seq, prev.seq_id, [PLACEHOLDER], start + 1, True, speculative=True)

    def _plan_admissions(self, batch: Any, budget: int, num_running: int) -> list[tuple[Sequence, str]]:
        """New (and preempted) sequences, in queue order, as placed allocations of this Step:
        the block manager picks each one's node (cached prefix, then free blocks; among the
        nodes in placement) and admits them in order while the step's token budget lasts
        (`admit_budget`), so one Step round trip places and admits (no Route). The rest are
        refused and wait. Sent: at most the free sequence slots, and prompts of at most
        `ADMIT_IDS_PER_BUDGET_TOKEN` x budget token ids in all (one at least, never more than
        `MAX_STEP_TOKEN_IDS`): enough for prefix hits to admit many, without resending the
        whole queue every step. So no queue, however long, and no prompt the context admits
        makes a request the block manager refuses."""
        slots = min(self.config.max_num_seqs - num_running, MAX_ADMISSIONS_PER_STEP)
        pools = sorted(nid for nid in self.nodes if nid not in self._down)
        if budget <= 0 or not self.waiting or slots <= 0 or not pools:
            return []
        batch.place_pools = pools
        batch.admit_budget = budget
        cap = min(MAX_STEP_TOKEN_IDS, ADMIT_IDS_PER_BUDGET_TOKEN * budget)
        admitted: list[tuple[Sequence, str]] = []   # (sequence, its new id)
        carried = 0
        for seq in itertools.islice(self.waiting, slots):
            tokens = seq.token_ids[: seq.prefill_target] if seq.fork_parent else seq.token_ids
            if admitted and carried + len(tokens) > cap:
                break
            seq_id = seq.new_admission_id()
            if seq.request.scoring_prompt:
                # by count: no prefix-cache hit skips a position whose log-probability is asked
                # (engine.prompt_scores); the blocks are not hashed either
                batch.allocate(seq_id, None, num_tokens=len(tokens))
            else:
                batch.allocate(seq_id, None, tokens, salt=seq.request.params.cache_salt)
            admitted.append((seq, seq_id))
            carried += len(tokens)
        return admitted

    def _apply_step_result(self, result: StepResult, plan: StepPlan, flight: InFlight | None) -> dict[str, list[Work]]:
        """What the block manager's answer means for each item: the step's work per node, and
        for each refused item the failure table's action (`engine.failure_policy`)."""
        work: dict[str, list[Work]] = {}

        def add(seq: Sequence, start: int, end: int) -> None:
            # a sequence samples once its whole prompt is computed (a fork parent stops one short)
            item = Work(seq, seq.seq_id or "", seq.token_ids[start:end], end, end >= seq.num_prompt)
            work.setdefault(seq.node_id or "", []).append(item)

        for sid, failure in result.late_failures.items():   # a bug or a race with a drop: say so
            log.warning("late_ids_refused", seq_id=sid, error=str(failure.error))
        dropped = set(result.dropped)
        for seq in list(self.running):
            if seq.seq_id in dropped:
                self._preempt(seq, free=False)   # its node's epoch ended: nothing left to free
        starved: list[Sequence] = []   # appends out of blocks: each preempts someone
        for w in plan.appends:
            out = result.appends.get(w.seq_id)
            if not w.live:
                continue
            if isinstance(out, ItemFailure):
                self._append_failed(w.seq, out, starved)
            elif out is not None:
                self.stats.late_tokens += w.speculative and not out.deferred   # the block manager awaits its id
                work.setdefault(w.seq.node_id or "", []).append(w)
        for parent, kids in plan.children_of.items():
            if parent.status is not SeqStatus.RUNNING:
                continue   # dropped with its node above; its children wait for its next fork
            fork = result.forks.get(parent.seq_id or "")
            if isinstance(fork, ItemFailure):
                action = self._act(Item.FORK, fork.error, parent.request)
                if action is Action.RECOMPUTE:
                    self._preempt(parent, free=False)   # the children stay FORKING for its next fork
                    continue
                if action is Action.ADMIT_ALONE:
                    # the parent goes on there (its append of this step stands); the children
                    # are admitted elsewhere on their own
                    for kid, _ in kids:
                        kid.detach()
                        self.waiting.appendleft(kid)
                    kids = []
                else:
                    continue   # the request failed
            parent.fork_parent = False
            for kid, kid_id in kids:
                kid.admit(kid_id, parent.node_id or "", parent.num_computed)
                self.running.append(kid)
            for s in (parent, *(kid for kid, _ in kids)):
                out = result.appends.get(s.seq_id or "")
                if out is None:
                    raise EngineFailure(f"append for {s.seq_id} got no answer")
                if isinstance(out, ItemFailure):
                    self._append_failed(s, out, starved)
                    continue
                add(s, s.num_computed, s.num_computed + 1)
        for seq, seq_id in plan.admitted:
            adm = result.allocations.get(seq_id)
            if adm is None:
                continue   # no answer for it: it waits (a new id next time)
            if isinstance(adm, ItemFailure):
                self._act(Item.ADMISSION, adm.error, seq.request)   # WAIT, or the request fails
                continue
            self.waiting.remove(seq)
            seq.admit(seq_id, adm.pool_id, adm.num_cached_tokens)
            if seq.request.num_cached_tokens == 0 and seq.index == 0:
                seq.request.num_cached_tokens = adm.num_cached_tokens
            self.stats.cached_prompt_tokens += adm.num_cached_tokens
            self.running.append(seq)
            add(seq, adm.num_cached_tokens, adm.num_tokens)
        if starved:
            busy = {w.seq for items in work.values() for w in items}
            if flight is not None:
                busy |= set(flight.by_seq)
            self._preempt_for(starved, busy)
        return work

    def _act(self, item: Item, error: BaseException, request: Request) -> Action:
        """The failure table's action for a refused item; the request-level ones done here
        (FAIL_REQUEST ends the request with the error; STOP_ENGINE raises EngineFailure)."""
        action = action_for(item, error)
        if action is Action.FAIL_REQUEST:
            log.warning("request_failed", request_id=request.request_id, item=item.value, error=str(error))
            self._fail_request(request, f"{item.value} refused: {error}")
        elif action is Action.STOP_ENGINE:
            raise EngineFailure(f"{item.value} of {request.request_id} failed: {error}")
        return action

    def _append_failed(self, seq: Sequence, out: ItemFailure, starved: list[Sequence]) -> None:
        """An append the block manager refused, by the failure table."""
        action = self._act(Item.APPEND, out.error, seq.request)
        if action is Action.PREEMPT_OTHER:
            starved.append(seq)
        elif action in (Action.RECOMPUTE, Action.RECOMPUTE_FREE):
            self._preempt(seq, free=action is Action.RECOMPUTE_FREE)

    def _preempt_for(self, starved: list[Sequence], busy: set[Sequence]) -> None:
        """Free the most recently admitted running sequences without work in this step or the
        one in flight, one per starved append (a starved sequence, whose append changed
        nothing, may be its own victim); they recompute later. A sequence with work is never a
        victim: its step's slots are assigned, so its Forward must write them."""
        for _ in starved:
            victims = [s for s in self.running if s not in busy]
            if not victims:
                return
            self.stats.num_preemptions += 1
            self._preempt_victim(victims[-1])


__all__ = ["StepPlan", "StepPlanner"]
