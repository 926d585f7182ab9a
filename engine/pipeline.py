"""The nodes' half of a step, and the overlap of one step's Generate with the next step's plan.

A committed step becomes one `Generate` per node (`_prepare`); `_run` calls the nodes (the
first on the engine thread, the others on a pool, in parallel); `_complete` reports every
Forward to the block manager (with a later Step), accepts the sampled tokens and applies the
failure table to the nodes that failed.

With `async_scheduling` (the default) `step()` plans and commits step N+1's block-manager Step
on a planner thread while the engine thread waits in step N's node calls (vLLM v1's async
scheduling, with the block manager in the scheduler's place); the engine thread calls the node
itself, so no thread hand-off sits on the node's path. What step N+1 needs from step N is only
the token each sampling sequence draws there, so step N+1 is planned as if none of them stopped:

- a sequence whose step-N work samples gets a *speculative* append of one token for N+1 whose
  id is not known yet (`PLACEHOLDER`). Inside the sequence's exclusive, partial last block the
  block manager client answers it in place (no block, no hash, no round trip;
  `TrackedSequence.can_append_locally`): when step N's token arrives it replaces the
  placeholder both in the work and in the client's deferred token ids, which go to the block
  manager with a later append. An append that starts or fills a block goes to the block
  manager with a *late id* (`num_late=1`): its slot is assigned now, the block holding it is
  hashed only once the id arrives, which it does with step N+2's Step
  (`SequenceTracker.resolve_late`). Only a sequence that is sure to stop at N (its length
  limit) sits step N+1 out;
- a sequence whose step-N work is a prompt chunk that does not sample plans its next chunk
  (its ids are known); a fork waits for its parent's prompt to be computed and reported.

Reconciling, when step N's answers arrive (`_prepare` of N+1): a sequence that stopped at N (a stop
token, its length, an abort) or was preempted drops its speculative work (its slot sat in a
partial block nobody else sees; its blocks go back with its free in the next Step); every other
sequence's placeholder becomes its real token. A node whose step N failed does not get step
N+1 either: that step is reported failed with N (the block manager drops what both wrote) and
its sequences recompute. No token is emitted twice or lost: a token is accepted only for the
admission (`seq_id`) that computed it, and greedy outputs equal a run without overlap.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from block_manager.client import PoolStepInfo
from engine.errors import EngineFailure, NodeError, NodeMovedOn
from engine.failure_policy import MAX_REFUSALS_IN_A_ROW, Action, Item, action_for
from engine.node_api import NodeStep, SampledToken, SamplingSpec, SeqStep
from engine.sequence import SeqStatus, Sequence
from pagedkv.logging import get_logger

PLACEHOLDER = -1             # the id of a speculative token until its step's answer arrives
NODE_THREADS = 64            # most nodes generating at once (threads start only as needed)
log = get_logger("engine.pipeline")


@dataclass(slots=True)
class Work:
    """One sequence's share of a node's Generate in one step."""

    seq: Sequence
    seq_id: str                  # the admission that computes it (a token is accepted only for it)
    token_ids: list[int]
    context_len: int
    sample: bool
    speculative: bool = False    # its one token is the one the step in flight samples

    @property
    def live(self) -> bool:
        """Whether its sequence still runs as the admission that planned it."""
        return self.seq.status is SeqStatus.RUNNING and self.seq.seq_id == self.seq_id


@dataclass(slots=True)
class NodeJob:
    node_id: str
    info: PoolStepInfo | None        # the block manager's step for the node's pool (reported after)
    items: list[Work]
    step: NodeStep
    answer: list[SampledToken] | NodeError | None = None


@dataclass(slots=True)
class InFlight:
    """A launched step: its Generates, and each sequence's work in it."""

    step_no: int
    jobs: list[NodeJob]
    by_seq: dict[Sequence, Work] = field(default_factory=dict)


class NodePipeline:
    """Launching steps on the nodes and completing them (mixed into `LLMEngine`)."""

    def _prepare(self, steps: dict[str, PoolStepInfo], work: dict[str, list[Work]],
                 failed: set[str]) -> InFlight | None:
        """Each node's Generate for a committed step. Speculative work is reconciled first (see
        the module docstring); a node that failed the previous step (`failed`) or is out of
        placement gets nothing: its pool step is reported failed and its sequences recompute."""
        jobs: list[NodeJob] = []
        for node_id in sorted(set(work) | set(steps)):
            items = work.get(node_id, [])
            info = steps.get(node_id)
            if node_id in failed or node_id in self._down:
                if info is not None:
                    self.client.report(info, False)
                for w in items:
                    if w.live:
                        self._preempt(w.seq, free=True)
                continue
            kept = [w for w in items if not w.speculative or self._reconcile(w)]
            if info is None and not kept:
                continue
            step = NodeStep(f"{node_id}-{self.stats.num_steps}-{id(self)}", [info] if info is not None else [],
                            [SeqStep(w.seq_id, w.token_ids, w.context_len, w.seq.num_output_tokens,
                                     _sampling(w.seq) if w.sample else None) for w in kept],
                            profile=self.config.profile_nodes)
            jobs.append(NodeJob(node_id, info, kept, step))
        if not jobs:
            return None
        flight = InFlight(self.stats.num_steps, jobs)
        for job in jobs:
            for w in job.items:
                flight.by_seq[w.seq] = w
        return flight

    def _run(self, flight: InFlight) -> None:
        """Call the nodes: the first on this thread, the others on the pool, in parallel. The
        engine thread itself waits in the node's call (its I/O or kernels let go of the GIL),
        so the next step's planning, on the planner thread, runs meanwhile without a thread
        hand-off on the node's path."""
        t0 = time.perf_counter()
        first, *others = flight.jobs
        if others and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=NODE_THREADS, thread_name_prefix="generate")
        futures = [(job, self._pool.submit(self._generate, job.node_id, job.step)) for job in others]  # type: ignore[union-attr]
        first.answer = self._generate(first.node_id, first.step)
        for job, future in futures:
            job.answer = future.result()
        self.stats.node_s += time.perf_counter() - t0

    def _reconcile(self, w: Work) -> bool:
        """Whether `w` goes to its node: a speculative token takes the id its previous step
        drew (here and in the block manager client: `resolve_late`), or is dropped when its
        sequence stopped or moved on. Work of known tokens always runs: its slots are the
        step's (a filled block may be hashed), so its Forward must write them."""
        if not w.speculative:
            return True
        seq = w.seq
        if not w.live or len(seq.token_ids) != w.context_len:
            self.stats.speculative_dropped += 1
            return False
        token = seq.token_ids[-1]
        w.token_ids = [token]
        # into the client's deferred ids (answered in place) or the next Step's late ids
        self.client.tracker.resolve_late(w.seq_id, [token])
        return True

    def _complete(self, flight: InFlight) -> set[str]:
        """A step's answers (`_run`): report each Forward, accept the tokens of the sequences
        that still run as the admission that computed them, and act on failures by the failure
        table. The nodes that failed."""
        now = time.perf_counter()
        failed: set[str] = set()
        for job in flight.jobs:
            answer = job.answer
            ok = answer is not None and not isinstance(answer, NodeError)
            action = self._node_action(job.node_id, answer) if isinstance(answer, NodeError) else None
            if job.info is not None:
                self.client.report(job.info, ok)
            if not ok:
                failed.add(job.node_id)
                self.stats.num_failed_steps += 1
                for w in job.items:
                    # The failed report drops the step's writers; the others (their tokens were
                    # answered locally) are freed: the Step skips frees of what it just dropped.
                    if w.live:
                        self._preempt(w.seq, free=True)
                if action is Action.TAKE_NODE_OUT:
                    self._take_out(job.node_id, str(answer))
                continue
            tokens = iter(answer)   # type: ignore[arg-type]
            for w in job.items:
                tok = next(tokens) if w.sample else None
                if not w.live:
                    continue   # stopped, aborted or preempted meanwhile: its token is not its
                w.seq.num_computed = w.context_len
                if tok is not None:
                    self._accept(w.seq, tok, now)
        return failed

    def _node_action(self, node_id: str, error: NodeError) -> Action:
        """The failure table's action for a node's failed step; STOP_ENGINE raises here (also
        for a node that moved on `MAX_REFUSALS_IN_A_ROW` steps in a row: not recovering)."""
        action = action_for(Item.NODE_STEP, error)
        if isinstance(error, NodeMovedOn):
            refusals = self._refusals[node_id] = self._refusals.get(node_id, 0) + 1
            if refusals > MAX_REFUSALS_IN_A_ROW:
                action = Action.STOP_ENGINE
            else:
                log.warning("node_refused_step", node_id=node_id, code=error.code, details=error.message)
        if action is Action.STOP_ENGINE:
            raise EngineFailure(f"node {node_id!r} refused a step: {error.code}: {error.message}") from error
        return action

    def _take_out(self, node_id: str, reason: str) -> None:
        """A node that did not answer leaves placement now (probed back in by `health`): its
        running sequences are freed and recomputed on the other nodes from the next step."""
        if not self.health.mark_down(node_id, reason):
            return
        self._down = self._down | {node_id}
        for seq in [s for s in self.running if s.node_id == node_id]:
            self._preempt(seq, free=True)

    def _generate(self, node_id: str, step: NodeStep) -> list[SampledToken] | NodeError:
        """The node's tokens, or its typed failure (acted on by the engine thread)."""
        try:
            tokens = self.nodes[node_id].generate(step)
        except NodeError as exc:
            return exc
        self._refusals[node_id] = 0
        return tokens


def _sampling(seq: Sequence) -> SamplingSpec:
    """The sequence's sampling for its node: the same every step, so built once (it is on the
    engine thread's path between two node calls)."""
    spec = seq.sampling_spec
    if spec is None:
        p = seq.request.params
        spec = seq.sampling_spec = SamplingSpec(p.temperature, p.top_p, p.top_k or 0, p.min_p, seq.seed, p.logprobs)
    return spec


__all__ = ["PLACEHOLDER", "InFlight", "NodeJob", "NodePipeline", "Work"]
