"""The engine: continuous batching over the block manager and the model nodes, one step at a time.

Each `step()`:

1. plans the step (`engine.scheduler`) under a token budget and a sequence cap: running
   sequences first (a decode token or the next prompt chunk), forks, then new requests as
   placed allocations (the block manager picks each one's node inside the same Step);
2. sends ONE `Step` to the block manager (frees of finished and preempted sequences, the
   reports of earlier Forwards, swaps, admissions, forks, appends with their token ids so
   generated text is prefix-cached too; in-block decode appends are answered by the client
   library without a round trip);
3. sends each node one `Generate` with its `PoolStepInfo` and its sequences' tokens
   (`engine.pipeline`); nodes run in parallel (data parallel). With `async_scheduling` (the
   default) a step's Generates are launched on the nodes' threads and left running: the next `step()`
   plans and commits its Step meanwhile, and returns its outputs with the step after it
   already running, so the step period approaches max(node time, engine time), not their
   sum; sequences are speculated not to stop and reconciled when the tokens arrive;
4. accepts the sampled tokens, applies stop rules and returns what changed.

What happens when part of a step fails is one table, `engine.failure_policy` (item kind x
typed error -> action), and a sequence's states and transitions are in one place,
`engine.sequence`. In short: an admission that does not fit waits; a running sequence whose
append does not fit preempts the most recently admitted idle sequence (swapped to its node's
host tier, `engine.swapping`, or recomputed later); a node that fails a step has it reported
failed (the block manager drops what it wrote) and its sequences recomputed, and a node that
does not answer leaves placement until a probe finds it back (`engine.health`).

The engine is a composition, each part with its own declared state and handed its
collaborators: the `Scheduler` (`engine.scheduler`: the queues, the plan, the reading of the
answer, the failure table's executor) with its `SwapPolicy` (`engine.swapping`), the
`NodePipeline` (`engine.pipeline`: the step in flight, the node threads), the `StepSender`
(`engine.bm_steps`: an unreachable block manager), `NodeHealth` and a `NodeView` of the nodes
(`engine.step_plan`). `LLMEngine` owns the requests, wires the parts and runs the step.

The scheduler speaks plain data to the nodes (`engine.node_api`) and typed errors from both
services; it imports neither grpc nor the node's protobuf.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from block_manager.client import BlockManagerClient, PoolStepInfo
from engine.async_policy import ASYNC_SCHEDULING_ENV
from engine.bm_steps import UNREACHABLE, StepSender
from engine.config import MAX_NUM_SEQS, PREEMPTION_MODES, EngineConfig, async_scheduling_default
from engine.discovery import BackgroundDiscovery, NodeDiscovery, node_problem
from engine.errors import EngineError, EngineFailure, NoNodeOwned
from engine.fleet import FleetMember
from engine.fleet_pools import FleetPools
from engine.health import NodeHealth
from engine.node_api import NodeExecutor, NodeInfo
from engine.params import CompletionOutput, InvalidParams, RequestOutput, SamplingParams
from engine.pipeline import NodePipeline
from engine.prompt_scores import Detokenize, start_scoring
from engine.queues import SeqQueues
from engine.scheduler import Scheduler
from engine.sequence import Request, SeqStatus, Sequence
from engine.stats import EngineStats
from engine.step_plan import InFlight, NodeView, Work
from engine.swapping import SwapPolicy
from pagedkv.logging import get_logger
from pagedkv.seeds import derive_seed

NO_CAPACITY_WAIT_S = 0.05    # a step that could run nothing sleeps this long before the next
PROBE_TIMEOUT_S = 2.0        # GetNodeInfo of a node out of placement (on the probing thread)
FLEET_DISCOVERY_S = 0.25     # a fleet member looks for newly owned pools this often (a local read)
log = get_logger("engine.llm_engine")


class LLMEngine:
    """One scheduler over one block manager (`client`) and model nodes (`nodes`, by pool id)."""

    def __init__(
        self,
        client: BlockManagerClient,
        nodes: dict[str, NodeExecutor],
        config: EngineConfig | None = None,
        *,
        detokenize: Detokenize | None = None,
        connect: Callable[[str, str], NodeExecutor] | None = None,
        fleet: FleetMember | None = None,
    ) -> None:
        """`nodes`: the model nodes by pool id. `connect(pool_id, address)`, when given, makes
        an executor for a node the block manager routes to but `nodes` lacks (one registered
        after the engine started) or whose address changed (a node restarted elsewhere): the
        engine adopts it once it serves the same model (`engine.discovery`).

        `fleet`: the engine joins the block manager's fleet (`engine.fleet`) and drives only the
        pools it is assigned; `nodes` then only tell it the model (those it does not own are
        closed) and it may own none for a while (`ready` is False then)."""
        if not nodes:
            raise EngineError("the engine needs at least one model node")
        self.client = client
        self.config = config or EngineConfig()
        self.detokenize = detokenize          # token ids -> text, or None
        infos = {nid: node.info() for nid, node in nodes.items()}
        first = next(iter(infos.values()))
        self.model_name = first.model
        self.vocab_size = first.vocab_size
        for nid, info in infos.items():
            problem = node_problem(info, self.model_name, self.vocab_size)
            if problem is not None:
                raise EngineError(f"node {nid!r} {problem}")
            client.tracker.set_block_size(nid, info.block_size)
        node_len = min(i.max_model_len for i in infos.values())
        self.max_kv_slots = max(i.num_blocks * i.block_size for i in infos.values())   # the largest node's
        self.stats = EngineStats()
        self.fleet = fleet
        if fleet is not None:   # joined before anything else: what it owns decides what it drives
            owned = fleet.join().owned
            for nid in [nid for nid in nodes if nid not in owned]:
                nodes[nid].close()
            nodes = {nid: node for nid, node in nodes.items() if nid in owned}
        self.view = NodeView(nodes, {nid: (infos[nid].num_blocks, infos[nid].block_size) for nid in nodes},
                             min(self.config.max_model_len or node_len, node_len))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.sender = StepSender(self.config.bm_unavailable_timeout_s)
        self.health = NodeHealth(self._probe)
        queues = SeqQueues(self.stats)
        swap = SwapPolicy(self.config, queues, self.view, self.stats)
        self.scheduler = Scheduler(self.config, client.tracker, self.view, queues, swap, self.health, self.stats,
                                   frozenset(first.eos_token_ids))
        self.pipeline = NodePipeline(self.config, client, self.view, self.scheduler, self.stats, detokenize)
        self.fleet_pools: FleetPools | None = None
        if fleet is not None:
            self.fleet_pools = FleetPools(fleet, self.view, self.scheduler, self.health, client, self.sender)
            for nid in self.nodes:
                self.fleet_pools.adopted(nid)
            fleet.start(load=lambda: (len(self.running), len(self.waiting)))
        self._discovery: BackgroundDiscovery | None = None
        if connect is not None:
            # a fleet member adopts the pools it is assigned, any other engine every routed pool
            discovery = NodeDiscovery(connect, first.model, first.vocab_size)
            if fleet is not None:
                self._discovery = BackgroundDiscovery(discovery, fleet.adoptable, lambda: self.nodes,
                                                      interval_s=FLEET_DISCOVERY_S)
            else:
                self._discovery = BackgroundDiscovery(discovery, lambda: client.route([0]), lambda: self.nodes)
            self._discovery.start()

    # ---- the parts' state, read through the engine ---------------------------------------------
    @property
    def nodes(self) -> dict[str, NodeExecutor]:
        return self.view.nodes

    @property
    def pool_blocks(self) -> dict[str, tuple[int, int]]:
        """Each node's (num_blocks, block_size)."""
        return self.view.pool_blocks

    @property
    def max_model_len(self) -> int:
        return self.view.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that stop a sequence (unless `ignore_eos`): the nodes', and `LLM` adds its
        tokenizer's."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: frozenset[int]) -> None:
        self.scheduler.eos_token_ids = token_ids

    @property
    def ready(self) -> bool:
        """Whether the engine drives a node (a fleet member may own none for a while: its
        requests wait, and routers should send them elsewhere)."""
        return bool(self.nodes)

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.queues.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.queues.running

    @property
    def swapped(self) -> deque[Sequence]:
        return self.scheduler.queues.swapped

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; `EngineError` / `InvalidParams` when it can never be served
        (`NoNodeOwned`: not by this engine now, a fleet member without a node)."""
        if self.fleet_pools is not None and self.fleet_pools.gave_up():
            raise NoNodeOwned(self.fleet_pools.NO_NODE)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidParams("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidParams(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise EngineError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(prompt + at least one generated token)"
            )
        if len(ids) + 1 > self.max_kv_slots:
            raise EngineError(f"the prompt needs {len(ids) + 1} KV slots; the largest node holds {self.max_kv_slots}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidParams(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, ids, params)
        start_scoring(req)
        req.outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None,
                                        top_logprobs=[] if params.logprobs else None) for i in range(params.n)]
        req.detok_offsets = [0] * params.n
        fork = params.n > 1 and len(ids) >= 2
        for i in range(params.n):
            seed = None if params.seed is None else derive_seed(params.seed, i)
            child = fork and i > 0      # admitted by the parent's fork
            seq = Sequence(req, i, list(ids), len(ids), seed, fork_parent=fork and i == 0,
                           status=SeqStatus.FORKING if child else SeqStatus.WAITING)
            req.seqs.append(seq)
            if not child:
                self.waiting.append(seq)
        self.requests[rid] = req
        self.stats.prompt_tokens += len(ids)
        return rid

    def abort_request(self, request_id: str) -> None:
        """Stop a request (a client went away): its sequences are freed with the next step."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.aborted = True
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        del self.requests[request_id]   # its blocks go back with the next step (or `flush`)
        self.scheduler.changed.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.requests)

    def kv_usage(self) -> float:
        """Fraction of the nodes' KV blocks in use (neither free nor evictable), as of the last
        Step answer: every Step answers each pool's free counts, so nothing is polled."""
        total = usable = 0
        for pool_id, (_num_free, num_usable) in self.view.pool_free.items():
            if pool_id in self.pool_blocks:
                total += self.pool_blocks[pool_id][0]
                usable += num_usable
        return 1.0 - usable / total if total else 0.0

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; the outputs of the requests that changed.

        Without `async_scheduling`: plan and commit the step's block-manager Step, run it on
        the nodes, accept its tokens. With it (`engine.pipeline`), step N is still running on
        the nodes when this call starts (the previous call launched it): step N+1 is planned
        and committed meanwhile, then N's tokens are accepted, N+1 is launched, and N's
        outputs are returned while the nodes run N+1, so neither the output processing nor
        the caller's own time between two calls sits between two runs of a node."""
        started = time.perf_counter()
        stats, pipeline = self.stats, self.pipeline
        if self.fleet is not None:
            self.fleet.ensure_fresh()
        self.view.down = self.health.down_nodes()
        if pipeline.flight is not None and (not self.config.async_scheduling or self._fleet_changes()):
            # overlap switched off with a step still running, or a fleet pool to drop or hand
            # over (nothing of it may be in flight): that step ends first
            self.drain()
        flight = pipeline.flight
        if flight is None:   # nothing on the nodes: this step is planned now
            self._adopt_found()
            if self.fleet_pools is not None:
                self.fleet_pools.apply()
            flight = pipeline.prepare(*self._schedule(None), self.view.down)
            if flight is not None and self.config.async_scheduling:
                pipeline.launch(flight)
        if flight is not None and self.config.async_scheduling:
            # step N+1's Step and Generates, while the nodes run step N (`flight`)
            following = pipeline.prepare(*self._schedule(flight), self.view.down)
            pipeline.wait(flight)
            self._adopt_found()   # between two runs of the nodes, never during one
            pipeline.advance(flight, following)
        elif flight is not None:
            pipeline.run(flight)
            pipeline.complete(flight)
        elif not self.running and self.waiting:
            # nothing could be admitted (no node admits sequences now: fenced, draining, full):
            # wait a little rather than spin on empty Steps
            time.sleep(NO_CAPACITY_WAIT_S)
        stats.num_steps += 1
        t0 = time.perf_counter()
        stats.step_s.append(t0 - started)
        outputs = self._collect_outputs()
        stats.outputs_s += time.perf_counter() - t0
        return outputs

    def _schedule(self, flight: InFlight | None) -> tuple[dict[str, PoolStepInfo], dict[str, list[Work]]]:
        """Plan this step (over the step in flight, if any), send its one Step, read the
        answer: each node's pool step and work."""
        self.sender.drain(wait=True)
        batch = self.client.step()
        plan = self.scheduler.plan(batch, flight)
        pending = self.client.pending_reports
        if (self.swapped or self.waiting or self.view.releasing) and pending:
            # Queued work waits on blocks that reports release (a swap-out's, a finished step's),
            # a pool handed over on its last report: send them even in a Step with nothing else,
            # so the answer's free counts move on.
            batch.flush = True
        lending = self.fleet_pools.lending_due() if self.fleet_pools is not None else 0
        if lending:
            batch.force = True   # this Step closes the owned pools' steps that carry serve grants
        t0 = time.perf_counter()
        result = self.sender.commit(batch)
        if lending and self.fleet_pools is not None:
            self.fleet_pools.lending_sent = lending
        self.stats.bm_s += time.perf_counter() - t0
        self.stats.num_bm_rpcs += result.num_rpcs
        if result.pool_free:
            self.view.pool_free = {pool: free for pool, free in result.pool_free.items()}
            self.view.host_pools = set(result.host_usable)
        steps = self._deliverable({pool: info for pool, info in result.steps.items()})
        return steps, self.scheduler.apply(result, plan, flight)

    def _probe(self, node_id: str) -> str | None:
        """Whether a node out of placement serves again (None) or why not; on `health`'s thread."""
        node = self.nodes.get(node_id)
        if node is None:
            return "no longer known"
        return node_problem(node.info(timeout_s=PROBE_TIMEOUT_S), self.model_name, self.vocab_size)

    def _adopt_found(self) -> None:
        """Adopt the nodes the background discovery found (one registered after the engine
        started, or a known pool at a new address): between two runs of the nodes, never
        while a node it replaces is running a step."""
        if self._discovery is None:
            return
        for pool_id, node, info in self._discovery.take():
            self._adopt(pool_id, node, info)

    def _adopt(self, pool_id: str, node: NodeExecutor, info: NodeInfo) -> None:
        if self.fleet is not None and not self.fleet.may_drive(pool_id):
            node.close()   # owned when it was found, not any more
            return
        previous = self.nodes.get(pool_id)
        if previous is not None and getattr(previous, "address", None) == getattr(node, "address", None):
            node.close()   # found twice (the discovery, and `_deliverable`'s adoption at once)
            return
        self.client.tracker.set_block_size(pool_id, info.block_size)
        self.pool_blocks[pool_id] = (info.num_blocks, info.block_size)
        self.view.max_model_len = min(self.view.max_model_len, info.max_model_len)
        if previous is not None:
            previous.close()
        self.nodes[pool_id] = node
        self.health.readmit(pool_id)   # it just answered GetNodeInfo with the engine's model
        self.view.down = self.view.down - {pool_id}
        self.max_kv_slots = max(self.max_kv_slots, info.num_blocks * info.block_size)
        if self.fleet_pools is not None:
            self.fleet_pools.adopted(pool_id)

    def _deliverable(self, steps: dict[str, PoolStepInfo]) -> dict[str, PoolStepInfo]:
        """`steps` without the PoolSteps of pools the engine does not drive, never handed to a
        node it has no executor for. A guard: a fleet member's Step closes the steps of every
        pool it owns that lends to another member's fetch, and an owned pool the discovery has
        not adopted yet could be one (the block manager lets a handed-over pool lend only once
        its new owner stepped on it, so it should not be). Such a pool is adopted now (probed on
        this thread) so its node gets the serve grant; one that cannot be is reported failed,
        as a node left out of a step (the borrower's node then recomputes the prefix)."""
        for pool_id in [p for p in steps if p not in self.nodes]:
            owned = self.fleet.view().owned.get(pool_id) if self.fleet is not None else None
            if owned is not None and self._discovery is not None and self.fleet is not None \
                    and self.fleet.may_drive(pool_id):
                for found in self._discovery.discovery.find([owned], self.nodes):
                    self._adopt(*found)
            if pool_id not in self.nodes:
                log.warning("pool_step_undeliverable", pool_id=pool_id)
                self.client.report(steps.pop(pool_id), False)
        return steps

    def _fleet_changes(self) -> bool:
        return self.fleet_pools is not None and self.fleet_pools.needs_idle_nodes()

    # ---- outputs ------------------------------------------------------------------------
    def _collect_outputs(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        changed, self.scheduler.changed = self.scheduler.changed, set()
        for rid in sorted(changed, key=lambda r: self.requests[r].arrival_s if r in self.requests else 0):
            req = self.requests.get(rid)
            if req is None:
                continue
            if self.detokenize is not None:
                for o in req.outputs:
                    o.text = self.detokenize(o.token_ids)
            done = req.finished
            scored = req.prompt_logprobs if not req.scoring_prompt else None
            outs.append(RequestOutput(rid, req.prompt, req.prompt_token_ids, req.outputs,
                                      req.num_cached_tokens, done, req.error, scored, req.unavailable))
            if done:
                del self.requests[rid]
                self.stats.num_finished += 1
        return outs

    def flush(self) -> None:
        """Send the last frees and reports (an idle engine: blocks back, plans can commit).
        With the block manager unreachable they wait for the next step or flush (a Step whose
        answer never came is resent first, under its request id). A fleet member also applies
        its assignment here (an idle engine adopts, drops and hands over pools too) and delivers
        the serve grants its pools hold for another member's prefix fetch."""
        self.drain()
        fleet = self.fleet_pools
        try:
            if fleet is not None:
                fleet.member.ensure_fresh()
                self.view.down = self.health.down_nodes()
                self._adopt_found()
                fleet.apply()
            self.sender.drain(wait=False)
            batch = self.client.step()
            lending = fleet.lending_due() if fleet is not None else 0
            # a fleet member's Step may close its lending pools' steps, reports alone too: their
            # PoolSteps go to the nodes (`_run_grants`), so its reports go this way as well
            if self.scheduler.add_frees(batch) or lending or (fleet is not None and self.client.pending_reports):
                batch.force = bool(lending)
                batch.flush = True
                result = self.sender.commit(batch, wait=False)
                if result.pool_free:
                    self.view.pool_free = {pool: free for pool, free in result.pool_free.items()}
                if fleet is not None:
                    fleet.lending_sent = max(fleet.lending_sent, lending)
                    self._run_grants(self._deliverable({pool: info for pool, info in result.steps.items()}))
            elif self.client.pending_reports:
                self.client.flush_reports()
        except UNREACHABLE as exc:
            log.warning("flush_failed", error=str(exc))

    def _run_grants(self, steps: dict[str, PoolStepInfo]) -> None:
        """The PoolSteps an idle fleet member's Step closed (serve grants for another member's
        prefix fetch, nothing of its own): each to its node, reported like any step's."""
        flight = self.pipeline.prepare(steps, {}, self.view.down)
        if flight is not None:
            self.pipeline.run(flight)
            self.pipeline.complete(flight)

    def drain(self) -> None:
        """Wait for the step running on the nodes (async scheduling) and accept its tokens:
        its nodes must write what the block manager gave them before anything is freed. Its
        outputs come with the next `step()`; its failures are acted on as in a step."""
        self.pipeline.drain()

    def close(self) -> None:
        """Free what is left, hand the pools back (another scheduler may drive them at once): a
        fleet member leaves the fleet, which releases every pool it owns."""
        try:
            for req in list(self.requests):
                self.abort_request(req)
            self.flush()
            if self.fleet is not None:
                self.fleet.leave()
            elif self.client.held_pools:
                self.client.release()
        except Exception:  # noqa: BLE001 - best effort: leases lapse on their own otherwise
            pass
        if self.fleet is not None:
            self.fleet.close()
        self.health.close()
        if self._discovery is not None:
            self._discovery.close()
        self.pipeline.close()


def generate_all(engine: LLMEngine, requests: Iterable[str]) -> None:
    """Step until every listed request finished."""
    pending = set(requests)
    while pending & set(engine.requests):
        engine.step()


__all__ = ["ASYNC_SCHEDULING_ENV", "MAX_NUM_SEQS", "PREEMPTION_MODES", "EngineConfig", "EngineError",
           "EngineFailure", "EngineStats", "LLMEngine", "async_scheduling_default"]
