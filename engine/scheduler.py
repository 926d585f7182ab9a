"""The scheduler: what each step asks of the block manager (`plan`), what its answer means
(`apply`), and what the nodes' tokens do to each sequence (`accept`). vLLM v1's
schedule / update-from-output split, with the block manager's Step between the two.

The plan, under a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
swap-outs and swap-ins (`engine.swapping`), running sequences (a decode token each, or the
next chunk of a long prompt: chunked prefill), forks of `n > 1` requests whose shared prompt is
computed, new requests in arrival order as placed allocations (the block manager picks each
one's node inside the same Step, within the budget), then the pending frees, those the planning
itself decided included. With a step in flight
(`engine.pipeline`), a sequence's plan starts where that step leaves it: a speculative decode
token (its id sent later), the next prompt chunk, or nothing yet.

The answer, item by item: what was granted becomes work per node; what was refused goes by
the failure table (`engine.failure_policy`), whose every action is carried out by one executor
here (`enact`). The scheduler owns the queues (`engine.queues`) and the swap policy; it reads
the nodes through a `NodeView` and never calls them (`engine.pipeline` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from block_manager.client import ItemFailure, SequenceTracker, StepResult, SyncStep
from block_manager.core.types import SeqId
from engine.config import EngineConfig
from engine.errors import EngineFailure, EpochDropped, NodeError
from engine.failure_policy import Action, Item, action_for
from engine.health import NodeHealth
from engine.node_api import SampledToken
from engine.queues import SeqQueues
from engine.sequence import Request, SeqStatus, Sequence
from engine.stats import EngineStats
from engine.step_plan import PLACEHOLDER, InFlight, NodeView, StepPlan, Work
from engine.swapping import SwapPolicy
from pagedkv.logging import get_logger

# Admission sizes that keep every Step inside what the block manager accepts (4096 items and
# 64 MiB by default) without resending the whole queue every step.
MAX_ADMISSIONS_PER_STEP = 256
ADMIT_IDS_PER_BUDGET_TOKEN = 8    # prompt token ids sent for admission per token of budget
MAX_STEP_TOKEN_IDS = 1 << 20      # admitted prompt token ids one Step carries (one admission at least)
log = get_logger("engine.scheduler")


class Scheduler:
    """Plans each step, reads its answer, accepts its tokens; the failure table's executor."""

    __slots__ = ("config", "tracker", "view", "queues", "swap", "health", "stats", "eos_token_ids",
                 "changed", "_starved")
    config: EngineConfig
    tracker: SequenceTracker          # the block manager client's mirror (is an admission's table known?)
    view: NodeView
    queues: SeqQueues
    swap: SwapPolicy
    health: NodeHealth
    stats: EngineStats
    eos_token_ids: frozenset[int]
    changed: set[str]                 # requests with news since the last outputs
    _starved: list[Sequence]          # this answer's appends out of blocks: each preempts someone

    def __init__(self, config: EngineConfig, tracker: SequenceTracker, view: NodeView, queues: SeqQueues,
                 swap: SwapPolicy, health: NodeHealth, stats: EngineStats, eos_token_ids: frozenset[int]) -> None:
        self.config, self.tracker, self.view, self.queues = config, tracker, view, queues
        self.swap, self.health, self.stats, self.eos_token_ids = swap, health, stats, eos_token_ids
        self.changed = set()
        self._starved = []

    # ---- plan -----------------------------------------------------------------------------
    def plan(self, batch: SyncStep, flight: InFlight | None) -> StepPlan:
        """Fill `batch` (this step's Step) over the step in flight, if any: swaps, the running
        sequences' appends and forks, admissions (none while a sequence waits on host), frees.

        The frees go in last, so those decided while planning go with this Step too: a swapped
        sequence given up here (its node out of placement) may be one this Step's failed report
        drops, and the block manager skips a free only in the Step whose report drops it; a
        Step later, it answers DoubleFree."""
        plan = StepPlan()
        self.swap.plan(batch, plan, self.refuse)
        budget = self._plan_running(batch, plan, self.config.max_num_batched_tokens, flight)
        if not self.queues.swapped:
            plan.admitted = self._plan_admissions(
                batch, budget, len(self.queues.running) + sum(map(len, plan.children_of.values())))
        self.add_frees(batch)
        return plan

    def add_frees(self, batch: SyncStep) -> bool:
        """Move the pending frees into `batch` (which carries them from here on, resent if its
        answer never comes). Whether there were any."""
        freeing = self.queues.take_frees()
        if freeing:
            batch.free(freeing)
        return bool(freeing)

    def _plan_running(self, batch: SyncStep, plan: StepPlan, budget: int, flight: InFlight | None) -> int:
        """Appends and forks of the running sequences; the budget left."""
        forks: list[Sequence] = []
        for seq in self.queues.running:
            if budget <= 0:
                break
            seq_id = seq.admitted.seq_id
            prev = flight.by_seq.get(seq) if flight is not None else None
            w: Work | None
            if prev is not None and prev.seq_id == seq_id:
                w = self._plan_after(seq, prev, budget)
            elif seq.fork_parent and seq.num_computed == seq.prefill_target:
                forks.append(seq)
                continue
            else:
                start = seq.num_computed
                n = min(len(seq.token_ids) - start, seq.prefill_target - start
                        if start < seq.prefill_target else 1, budget)
                w = None if n <= 0 else Work(seq, seq_id, seq.token_ids[start : start + n], start + n,
                                             start + n >= seq.num_prompt)
            if w is None:
                continue
            batch.append(w.seq_id, w.token_ids, num_late=1 if w.speculative else 0)
            plan.appends.append(w)
            budget -= len(w.token_ids)
        for parent in forks:
            parent_id = parent.admitted.seq_id
            kids = [(s, s.new_admission_id()) for s in parent.request.seqs if s.status is SeqStatus.FORKING]
            batch.fork(parent_id, [kid_id for _, kid_id in kids])
            plan.children_of[parent] = kids
            # each computes the last prompt token and samples
            batch.append(parent_id, [parent.token_ids[-1]])
            for _, kid_id in kids:
                batch.append(kid_id, [parent.token_ids[-1]])
            budget -= 1 + len(kids)
        return budget

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
        if seq.num_output_tokens + 1 >= p.max_tokens or start + 1 >= self.view.max_model_len:
            return None              # its token in flight is its last
        if self.tracker.get(prev.seq_id) is None:
            self.stats.speculation_waits += 1
            return None              # not mirrored (its Step's outcome was unknown): wait for its id
        self.stats.speculative_tokens += 1
        return Work(seq, prev.seq_id, [PLACEHOLDER], start + 1, True, speculative=True)

    def _plan_admissions(self, batch: SyncStep, budget: int, num_running: int) -> list[tuple[Sequence, str]]:
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
        closed = self.view.down | self.view.releasing
        pools = sorted(nid for nid in self.view.nodes if nid not in closed)
        if budget <= 0 or not self.queues.waiting or slots <= 0 or not pools:
            return []
        batch.place_pools = pools
        batch.admit_budget = budget
        cap = min(MAX_STEP_TOKEN_IDS, ADMIT_IDS_PER_BUDGET_TOKEN * budget)
        admitted: list[tuple[Sequence, str]] = []   # (sequence, its new id)
        carried = 0
        for seq in itertools.islice(self.queues.waiting, slots):
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

    # ---- apply (the Step's answer) -----------------------------------------------------------
    def apply(self, result: StepResult, plan: StepPlan, flight: InFlight | None) -> dict[str, list[Work]]:
        """What the block manager's answer means for each item: the step's work per node; each
        refused item goes by the failure table."""
        self.swap.apply(result, plan, self.refuse)
        work: dict[str, list[Work]] = {}
        self._starved = []
        for sid, failure in result.late_failures.items():
            self.enact(action_for(Item.LATE_IDS, failure.error), Item.LATE_IDS, failure.error, label=sid)
        dropped = set(result.dropped)
        for seq in list(self.queues.running):
            if seq.admitted.seq_id in dropped:
                self.refuse(Item.HELD, EpochDropped(seq.admitted.seq_id), seq)
        for w in plan.appends:
            out = result.appends.get(SeqId(w.seq_id))
            if not w.live:
                continue
            if isinstance(out, ItemFailure):
                self.refuse(Item.APPEND, out.error, w.seq)
            elif out is not None:
                self.stats.late_tokens += w.speculative and not out.deferred   # the block manager awaits its id
                work.setdefault(w.seq.admitted.node_id, []).append(w)
        for parent, kids in plan.children_of.items():
            self._apply_fork(result, parent, kids, work)
        for seq, seq_id in plan.admitted:
            adm = result.allocations.get(SeqId(seq_id))
            if adm is None:
                continue   # no answer for it: it waits (a new id next time)
            if isinstance(adm, ItemFailure):
                self.refuse(Item.ADMISSION, adm.error, seq)
                continue
            self.queues.admit(seq, seq_id, adm.pool_id, adm.num_cached_tokens)
            if seq.request.num_cached_tokens == 0 and seq.index == 0:
                seq.request.num_cached_tokens = adm.num_cached_tokens
            self.stats.cached_prompt_tokens += adm.num_cached_tokens
            _add_work(work, seq, adm.num_cached_tokens, adm.num_tokens)
        if self._starved:
            busy = {w.seq for items in work.values() for w in items}
            if flight is not None:
                busy |= set(flight.by_seq)
            self._preempt_for(self._starved, busy)
        # A free queued while this answer was read (a refused swap-out, say) of a sequence the
        # answer's reports dropped is moot: the block manager holds nothing of it any more and
        # would answer the next Step's free DoubleFree.
        self.queues.forget_frees(dropped)
        return work

    def _apply_fork(self, result: StepResult, parent: Sequence, kids: list[tuple[Sequence, str]],
                    work: dict[str, list[Work]]) -> None:
        if parent.status is not SeqStatus.RUNNING:
            return   # dropped with its node; its children wait for its next fork
        fork = result.forks.get(SeqId(parent.admitted.seq_id))
        if isinstance(fork, ItemFailure):
            action = self.refuse(Item.FORK, fork.error, parent)
            if action is not Action.ADMIT_ALONE:
                return   # recomputed (the children stay FORKING for its next fork), or failed
            kids = []    # the parent goes on there (its append of this step stands)
        parent.fork_parent = False
        for kid, kid_id in kids:
            kid.admit(kid_id, parent.admitted.node_id, parent.num_computed)
            self.queues.running.append(kid)
        for s in (parent, *(kid for kid, _ in kids)):
            if s.status is not SeqStatus.RUNNING:
                continue   # its request failed with an append before it
            out = result.appends.get(SeqId(s.admitted.seq_id))
            if out is None:
                raise EngineFailure(f"append for {s.seq_id} got no answer")
            if isinstance(out, ItemFailure):
                self.refuse(Item.APPEND, out.error, s)
                continue
            _add_work(work, s, s.num_computed, s.num_computed + 1)

    def _preempt_for(self, starved: list[Sequence], busy: set[Sequence]) -> None:
        """Free the most recently admitted running sequences without work in this step or the
        one in flight, one per starved append (a starved sequence, whose append changed
        nothing, may be its own victim); they swap or recompute later. A sequence with work is
        never a victim: its step's slots are assigned, so its Forward must write them."""
        for _ in starved:
            victims = [s for s in self.queues.running if s not in busy]
            if not victims:
                return
            self.stats.num_preemptions += 1
            self.swap.preempt_victim(victims[-1])

    # ---- the failure table's executor ----------------------------------------------------------
    def refuse(self, item: Item, error: BaseException, seq: Sequence) -> Action:
        """The failure table's action for one refused item of `seq`, carried out."""
        action = action_for(item, error)
        self.enact(action, item, error, (seq,))
        return action

    def enact(self, action: Action, item: Item, error: BaseException, seqs: Seq[Sequence] = (), *,
              node_id: str | None = None, label: str = "") -> None:
        """Carry out `action` for a failed `item`: the one place each action is done.
        `seqs`: the item's sequence (a node step's: its live ones); `node_id`: a node step's
        node; `label`: what to log for an item without a sequence (a late id)."""
        if action is Action.WAIT:
            return   # stays queued (an admission) or swapped (a swap-in); tried again next step
        if action is Action.LOG:
            log.warning("item_refused", item=item.value, seq_id=label, error=str(error))
        elif action is Action.PREEMPT_OTHER:
            self._starved.extend(seqs)       # each preempts a victim once the answer is read
        elif action in (Action.RECOMPUTE, Action.RECOMPUTE_FREE, Action.TAKE_NODE_OUT):
            for seq in seqs:
                self.recompute(seq, free=action is not Action.RECOMPUTE)
            if action is Action.TAKE_NODE_OUT and node_id is not None:
                self.take_out(node_id, str(error))
        elif action is Action.ADMIT_ALONE:
            for parent in seqs:              # its children are admitted elsewhere on their own
                for kid in [s for s in parent.request.seqs if s.status is SeqStatus.FORKING]:
                    kid.detach()
                    self.queues.waiting.appendleft(kid)
        elif action is Action.FAIL_REQUEST:
            for request in dict.fromkeys(seq.request for seq in seqs):
                log.warning("request_failed", request_id=request.request_id, item=item.value, error=str(error))
                self.fail_request(request, f"{item.value} refused: {error}")
        elif action is Action.STOP_ENGINE:
            if isinstance(error, NodeError):
                node = node_id if node_id is not None else error.node_id
                raise EngineFailure(f"node {node!r} refused a step: {error.code}: {error.message}") from error
            what = seqs[0].request.request_id if seqs else label
            raise EngineFailure(f"{item.value} of {what} failed: {error}") from error
        else:   # RESEND: only StepSender can resend a Step (engine.bm_steps)
            raise EngineFailure(f"{action.value} for {item.value} is not the scheduler's to do: {error}") from error

    def recompute(self, seq: Sequence, *, free: bool) -> None:
        """Give up `seq`'s blocks and queue it to recompute everything it has: a running one
        (preempted) or a swapped one (the swap's fallback). `free`: its blocks still exist."""
        if seq.status is SeqStatus.SWAPPED:
            self.swap.recompute(seq, free=free)
        else:
            self.queues.preempt(seq, free=free)

    def take_out(self, node_id: str, reason: str) -> None:
        """A node that did not answer leaves placement now (probed back in by `health`): its
        running sequences are freed and recomputed on the other nodes from the next step."""
        if not self.health.mark_down(node_id, reason):
            return
        self.view.down = self.view.down | {node_id}
        for seq in [s for s in self.queues.running if s.admitted.node_id == node_id]:
            self.queues.preempt(seq, free=True)

    # ---- the nodes' tokens (update from output) ---------------------------------------------
    def accept(self, seq: Sequence, tok: SampledToken, now: float) -> None:
        """A token `seq`'s node sampled: appended to its output, then its stop rules."""
        req, out = seq.request, seq.output
        token = tok.token_id
        seq.token_ids.append(token)
        out.token_ids.append(token)
        if out.logprobs is not None:
            out.logprobs.append(tok.logprob if tok.logprob is not None else 0.0)
        if out.top_logprobs is not None:
            out.top_logprobs.append(list(tok.top_logprobs))
        self.stats.generated_tokens += 1
        if req.first_token_s is None:
            req.first_token_s = now
            self.stats.ttft_s.append(now - req.arrival_s)
        elif seq.last_token_s is not None:
            self.stats.itl_s.append(now - seq.last_token_s)
        seq.last_token_s = now
        self.changed.add(req.request_id)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            self.finish(seq, "stop")
        elif len(out.token_ids) >= p.max_tokens or len(seq.token_ids) >= self.view.max_model_len:
            self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        """`seq` is done (stop, length, abort, error): out of its queue, its blocks freed with
        the next Step."""
        self.changed.add(seq.request.request_id)
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.output.finish_reason is None:
            seq.output.finish_reason = reason
        if seq.status is SeqStatus.SWAPPED:
            self.swap.forget(seq)
        self.queues.finish(seq)

    def fail_request(self, request: Request, message: str) -> None:
        """The request cannot be served: every completion ends with finish reason "error"."""
        request.error = message
        for seq in request.seqs:
            self.finish(seq, "error")


def _add_work(work: dict[str, list[Work]], seq: Sequence, start: int, end: int) -> None:
    """`seq`'s tokens [start, end) as work on its node; it samples once its whole prompt is
    computed (a fork parent stops one short)."""
    held = seq.admitted
    work.setdefault(held.node_id, []).append(Work(seq, held.seq_id, seq.token_ids[start:end], end,
                                                  end >= seq.num_prompt))


__all__ = ["MAX_ADMISSIONS_PER_STEP", "Scheduler"]
