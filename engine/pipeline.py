"""The nodes' half of a step (`NodePipeline`: the step in flight, the node threads), and the overlap
of the nodes' run of one step with the rest.

A committed step becomes one `Generate` per node (`prepare`); `run` calls the nodes (the
first on the engine thread, the others on their own threads, in parallel); `complete` reports every
Forward to the block manager (with a later Step), accepts the sampled tokens and applies the
failure table to the nodes that failed.

With `async_scheduling` (the default) the nodes are never idle waiting for the engine (vLLM
v1's async scheduling, with the block manager in the scheduler's place). The node calls run on
a thread per node (`launch`, `wait`), and step N is still running there when `step()` is called:

    step():  plan N+1 + its Step + its Generates | wait for N | fill N+1, launch it | accept N,
             reconcile N+1 | return N's outputs   (the caller's time: N+1 runs meanwhile)

So between two runs of a node there is only the hand-over of the answers and the filling of
N+1's speculative tokens. What step N+1 needs from step N is only the token each sampling
sequence draws there, so step N+1 is planned as if none of them stopped:

- a sequence whose step-N work samples gets a *speculative* append of one token for N+1 whose
  id is not known yet (`PLACEHOLDER`). Inside the sequence's exclusive, partial last block the
  block manager client answers it in place (no block, no hash, no round trip;
  `TrackedSequence.can_append_locally`). An append that starts or fills a block goes to the
  block manager with a *late id* (`num_late=1`): its slot is assigned now, the block holding
  it is hashed only once the id arrives. Only a sequence that is sure to stop at N (its length
  limit) sits step N+1 out;
- a sequence whose step-N work is a prompt chunk that does not sample plans its next chunk
  (its ids are known); a fork waits for its parent's prompt to be computed and reported.

Filling (`fill`, N answered): each speculative token takes the id N's answer drew for its
sequence, and N+1 is launched before N's tokens are accepted. Reconciling (`reconcile`, once
they are): the id goes to the block manager client (into the deferred ids of an append answered
in place, or as the late id of the next Step: `SequenceTracker.resolve_late`); a sequence that
stopped at N (a stop token) has its speculative token computed for nothing, and it is not
accepted (its slot sat in a partial block nobody else sees, or in a block never hashed; its
blocks go back with its free in the next Step). Speculative work whose sequence stopped or moved
on before N+1 was prepared (an abort, a preemption) is left out. When a node failed step N, N's answers
are acted on first and N+1 leaves that node out: its step is reported failed after N's (the
block manager drops what both wrote) and its sequences recompute. No token is emitted twice or
lost: a token is accepted only for the admission (`seq_id`) that computed it, and greedy
outputs equal a run without overlap.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from block_manager.client import BlockManagerClient, PoolStepInfo
from engine.config import EngineConfig
from engine.errors import EngineFailure, NodeError, NodeMovedOn
from engine.failure_policy import Action, Item, NodeRefusals
from engine.node_api import NodeStep, SampledToken, SamplingSpec, SeqStep, StepAnswer
from engine.prompt_scores import Detokenize, answer_matches, scoring_spec, store_scores
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.step_plan import PLACEHOLDER, InFlight, NodeJob, NodeView, Work
from pagedkv.logging import get_logger

log = get_logger("engine.pipeline")


class NodePipeline:
    """Launching steps on the nodes and completing them; owns the step in flight and the node
    threads. Tokens and failures go to the `scheduler` (`accept`, `enact`)."""

    __slots__ = ("config", "client", "view", "scheduler", "stats", "detokenize", "flight", "refusals",
                 "_node_threads", "_launches")
    config: EngineConfig
    client: BlockManagerClient           # reports each step's Forward; the mirror of late ids
    view: NodeView
    scheduler: Scheduler
    stats: EngineStats
    detokenize: Detokenize | None        # for the prompt scores' tokens
    flight: InFlight | None              # async scheduling: the step running on the nodes between two calls
    refusals: NodeRefusals               # steps each node refused in a row
    _node_threads: dict[str, ThreadPoolExecutor]   # node -> the thread that calls it
    _launches: itertools.count[int]      # a unique id for every node step

    def __init__(self, config: EngineConfig, client: BlockManagerClient, view: NodeView, scheduler: Scheduler,
                 stats: EngineStats, detokenize: Detokenize | None) -> None:
        self.config, self.client, self.view, self.scheduler = config, client, view, scheduler
        self.stats, self.detokenize = stats, detokenize
        self.flight = None
        self.refusals = NodeRefusals()
        self._node_threads = {}
        self._launches = itertools.count()

    def prepare(self, steps: dict[str, PoolStepInfo], work: dict[str, list[Work]],
                leave_out: frozenset[str]) -> InFlight | None:
        """Each node's Generate for a committed step (None: nothing to run). A speculative
        token is a placeholder in its `SeqStep` until `fill` (see the module docstring);
        speculative work whose sequence stopped or moved on since it was planned is dropped.
        The nodes in `leave_out` get nothing (`leave_out`)."""
        t0 = time.perf_counter()
        jobs: list[NodeJob] = []
        speculative: list[tuple[Work, SeqStep]] = []
        launch_no = next(self._launches)
        for node_id in sorted(set(work) | set(steps)):
            info = steps.get(node_id)
            kept: list[Work] = []
            seq_steps: list[SeqStep] = []
            for w in work.get(node_id, ()):
                seq = w.seq
                if not w.speculative:
                    if seq.request.prompt_logprobs is not None:   # only a request that asks pays for it
                        w.scoring = scoring_spec(seq, w.context_len - len(w.token_ids), w.context_len)
                    seq_steps.append(SeqStep(w.seq_id, w.token_ids, w.context_len, seq.num_output_tokens,
                                             _sampling(seq) if w.sample else None, w.scoring))
                elif w.live:
                    # its index counts the token in flight, accepted or not yet
                    ss = SeqStep(w.seq_id, w.token_ids, w.context_len,
                                 seq.num_output_tokens + w.context_len - len(seq.token_ids), _sampling(seq))
                    seq_steps.append(ss)
                    speculative.append((w, ss))
                else:
                    self.stats.speculative_dropped += 1
                    continue
                kept.append(w)
            if info is None and not kept:
                continue
            step = NodeStep(f"{node_id}-{launch_no}-{id(self)}", [info] if info is not None else [], seq_steps,
                            profile=self.config.profile_nodes)
            jobs.append(NodeJob(node_id, info, kept, step))
        flight = InFlight(jobs, speculative=speculative)
        for job in jobs:
            for w in job.items:
                flight.by_seq[w.seq] = w
        self.leave_out(flight, leave_out)
        self.stats.prepare_s += time.perf_counter() - t0
        return flight if flight.jobs else None

    def leave_out(self, flight: InFlight, node_ids: frozenset[str] | set[str]) -> None:
        """Take the nodes in `node_ids` (they failed the step before, or are out of placement)
        out of a step not launched yet: each one's pool step is reported failed (the block
        manager drops what it would have written) and its sequences recompute."""
        if not node_ids.intersection(job.node_id for job in flight.jobs):
            return
        kept: list[NodeJob] = []
        for job in flight.jobs:
            if job.node_id not in node_ids:
                kept.append(job)
                continue
            if job.info is not None:
                self.client.report(job.info, False)
            for w in job.items:
                flight.by_seq.pop(w.seq, None)
                if w.live:
                    self.scheduler.recompute(w.seq, free=True)
        flight.jobs = kept
        flight.speculative = [(w, ss) for w, ss in flight.speculative if flight.by_seq.get(w.seq) is w]

    def fill(self, following: InFlight, flight: InFlight) -> None:
        """Give each speculative token of `following` the id its sequence drew in `flight`
        (its step before; the nodes that failed it are left out of `following`). Done before
        `flight`'s tokens are accepted, so the nodes start at once; `reconcile` checks them
        against the acceptance after."""
        if not following.speculative:
            return
        drawn: dict[str, int] = {}
        for job in flight.jobs:
            tokens = job.tokens
            if tokens is not None:
                drawn.update((t.seq_id, t.token_id) for t in tokens)
        for w, ss in following.speculative:
            token = drawn.get(w.seq_id)
            if token is None:
                raise EngineFailure(f"node {w.seq.node_id!r} drew no token for {w.seq_id} (it sampled there)")
            ss.token_ids = w.token_ids = [token]

    def run(self, flight: InFlight) -> None:
        """Call the nodes and wait for their answers (no overlap): the first on this thread, the
        others on their threads, in parallel."""
        t0 = time.perf_counter()
        first, *others = flight.jobs
        futures = [(job, self._node_thread(job.node_id).submit(self._generate, job.node_id, job.step))
                   for job in others]
        first.answer = self._generate(first.node_id, first.step)
        for job, future in futures:
            job.answer = future.result()
        self.stats.node_s += time.perf_counter() - t0

    def launch(self, flight: InFlight) -> None:
        """Start the nodes on their threads and return once each has started (async scheduling).

        Why wait for the start: a thread woken while another holds the GIL waits up to the
        interpreter's switch interval (5 ms) to run, unless the holder blocks. The engine
        thread goes on to the caller and the next plan, pure Python that seldom blocks, so
        without this the node's call could start milliseconds late. Blocked here instead, it
        hands the GIL over; each node's call takes it until its I/O or kernels let it go."""
        self.flight = flight   # waited for by the next step(), or by `drain`
        flight.started_s = time.perf_counter()
        started = threading.Semaphore(0)
        flight.futures = [self._node_thread(job.node_id).submit(self._start_generate, started, job.node_id, job.step)
                          for job in flight.jobs]
        for _ in flight.jobs:
            started.acquire()

    def wait(self, flight: InFlight) -> None:
        """The answers of a launched step (`launch`)."""
        for job, future in zip(flight.jobs, flight.futures):
            job.answer = future.result()
        flight.futures = []
        self.flight = None
        self.stats.node_s += time.perf_counter() - flight.started_s

    def drain(self) -> None:
        """Wait for the step in flight, if any, and complete it."""
        flight = self.flight
        if flight is not None:
            self.wait(flight)
            self.complete(flight)

    def advance(self, flight: InFlight, following: InFlight | None) -> None:
        """Accept answered step N (`flight`) and launch step N+1 (`following`, prepared while
        N ran). When every node answered N, N+1 starts first (its speculative tokens take their
        ids from N's answers) and N's tokens are accepted while it runs, then N+1 is reconciled
        with them. A node that failed N is acted on first and left out of N+1."""
        failed = {job.node_id for job in flight.jobs if job.tokens is None}
        if failed:
            failed = self.complete(flight)
            if following is not None:
                self.leave_out(following, failed)
        launched = following if following is not None and following.jobs else None
        if launched is not None:
            self.fill(launched, flight)
            self.launch(launched)
        if not failed:
            self.complete(flight)
        if launched is not None:
            self.reconcile(launched)

    def reconcile(self, flight: InFlight) -> None:
        """After the step before was accepted: each speculative token of launched `flight`
        whose sequence went on as speculated has its id sent to the block manager client
        (answered in place into its deferred ids, or as a late id with the next Step). One whose
        sequence stopped there (a stop token), was aborted or preempted is dropped: the node
        computes it anyway, its token is not accepted, its slot goes with the sequence's free."""
        for w, _ in flight.speculative:
            seq = w.seq
            if w.live and len(seq.token_ids) == w.context_len and seq.token_ids[-1] == w.token_ids[0]:
                self.client.tracker.resolve_late(w.seq_id, w.token_ids)
            else:
                w.dropped = True
                flight.by_seq.pop(seq, None)
                self.stats.speculative_dropped += 1

    def complete(self, flight: InFlight) -> set[str]:
        """A step's answers (`run`): report each Forward, accept the tokens of the sequences
        that still run as the admission that computed them, and act on failures by the failure
        table. The nodes that failed."""
        now = time.perf_counter()
        failed: set[str] = set()
        for job in flight.jobs:
            tokens = job.tokens
            if tokens is None:
                failed.add(job.node_id)
                self._failed(job)
                continue
            if job.info is not None:
                self.client.report(job.info, True)
            it = iter(tokens)
            for w in job.items:
                tok = next(it) if w.sample else None
                if not w.live:
                    continue   # stopped, aborted or preempted meanwhile: its token is not its
                w.seq.num_computed = w.context_len
                if w.scoring is not None and not self._store_scores(job.node_id, w, tokens):
                    continue
                if tok is not None:
                    self.scheduler.accept(w.seq, tok, now)
        self.stats.complete_s += time.perf_counter() - now
        return failed

    def _failed(self, job: NodeJob) -> None:
        """A node's failed step, by the failure table (NODE_STEP): STOP_ENGINE before anything
        is reported; else its step is reported failed (the block manager drops what it wrote)
        and its live sequences are freed and recomputed (the others' tokens were answered
        locally: the Step skips frees of what it just dropped), the node taken out if so."""
        error = job.answer
        action = Action.RECOMPUTE_FREE   # never answered (not a node's failure): its sequences recompute
        if isinstance(error, NodeError):
            action = self.refusals.action(job.node_id, error)
            if action is Action.STOP_ENGINE:
                self.scheduler.enact(action, Item.NODE_STEP, error, node_id=job.node_id)
            if isinstance(error, NodeMovedOn):
                log.warning("node_refused_step", node_id=job.node_id, code=error.code, details=error.message)
        if job.info is not None:
            self.client.report(job.info, False)
        self.stats.num_failed_steps += 1
        failure: BaseException = error if isinstance(error, NodeError) else EngineFailure("the node step got no answer")
        self.scheduler.enact(action, Item.NODE_STEP, failure, [w.seq for w in job.items if w.live],
                             node_id=job.node_id)

    def _store_scores(self, node_id: str, w: Work, answer: list[SampledToken]) -> bool:
        """Keep the prompt scores a node answered for `w`; a node that answered none (one that
        predates prompt scoring ignores the request's field) fails the request, not the engine."""
        spec = w.scoring
        scores = answer.prompt_logprobs.get(w.seq_id) if isinstance(answer, StepAnswer) else None
        if spec is None or not answer_matches(spec, scores) or scores is None:
            self.scheduler.fail_request(w.seq.request, f"node {node_id!r} did not answer the prompt "
                                                       "log-probabilities it was asked for")
            return False
        store_scores(w.seq.request, w.context_len - len(w.token_ids), scores, spec, self.detokenize)
        return True

    def _start_generate(self, started: threading.Semaphore, node_id: str,
                        step: NodeStep) -> list[SampledToken] | NodeError:
        started.release()
        return self._generate(node_id, step)

    def _node_thread(self, node_id: str) -> ThreadPoolExecutor:
        """The thread that calls `node_id` (made on first use). One per node, always the same:
        an in-process node's per-thread state (the CUDA device and stream, Numba's and
        OpenMP's thread pools) is set up once, and calls to one node never overlap."""
        thread = self._node_threads.get(node_id)
        if thread is None:
            thread = self._node_threads[node_id] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"generate-{node_id}")
        return thread

    def _generate(self, node_id: str, step: NodeStep) -> list[SampledToken] | NodeError:
        """The node's tokens, or its typed failure (acted on by the engine thread)."""
        try:
            tokens = self.view.nodes[node_id].generate(step)
        except NodeError as exc:
            return exc
        self.refusals.answered(node_id)
        return tokens

    def close(self) -> None:
        for thread in self._node_threads.values():
            thread.shutdown(wait=True)


def _sampling(seq: Sequence) -> SamplingSpec:
    """The sequence's sampling for its node: the same every step, so built once (it is on the
    engine thread's path between two node calls)."""
    spec = seq.sampling_spec
    if spec is None:
        p = seq.request.params
        spec = seq.sampling_spec = SamplingSpec(p.temperature, p.top_p, p.top_k or 0, p.min_p, seq.seed, p.logprobs)
    return spec


__all__ = ["PLACEHOLDER", "InFlight", "NodeJob", "NodePipeline", "Work"]
