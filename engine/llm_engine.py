"""The engine: continuous batching over the block manager and the model nodes, one step at a time.

Each `step()`:

1. plans the step (`engine.planning`) under a token budget and a sequence cap: running
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

The scheduler speaks plain data to the nodes (`engine.node_api`) and typed errors from both
services; it imports neither grpc nor the node's protobuf.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from block_manager.client import BlockManagerClient, PoolStepInfo
from engine.async_policy import ASYNC_SCHEDULING_ENV, async_scheduling_from_env
from engine.bm_steps import UNREACHABLE, StepSender
from engine.discovery import BackgroundDiscovery, NodeDiscovery, node_problem
from engine.errors import EngineError, EngineFailure
from engine.health import NodeHealth
from engine.node_api import NodeExecutor, SampledToken
from engine.params import CompletionOutput, InvalidParams, RequestOutput, SamplingParams
from engine.pipeline import InFlight, NodePipeline, Work
from engine.planning import StepPlanner
from engine.prompt_scores import start_scoring
from engine.sequence import Request, SeqStatus, Sequence
from engine.stats import EngineStats
from engine.swapping import SwapPreemption
from pagedkv.logging import get_logger
from pagedkv.seeds import derive_seed

NO_CAPACITY_WAIT_S = 0.05    # a step that could run nothing sleeps this long before the next
MAX_NUM_SEQS = 4096          # a Step's appends (one per running sequence) stay within its item limit
PROBE_TIMEOUT_S = 2.0        # GetNodeInfo of a node out of placement (on the probing thread)
log = get_logger("engine.llm_engine")


def async_scheduling_default() -> bool:
    """Overlap is on unless `PAGEDKV_ASYNC_SCHEDULING` is 0/false/off/no (`LLM` decides by its
    nodes instead, `engine.async_policy`)."""
    return async_scheduling_from_env() is not False


PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 256               # running sequences at once
    max_num_batched_tokens: int = 2048    # new tokens per step (chunked prefill splits prompts)
    max_model_len: int | None = None      # None: the nodes' (the smallest)
    # How long a step waits out an unreachable block manager (a restart, a network blip),
    # resending it under its request id, before the engine gives up (EngineFailure).
    bm_unavailable_timeout_s: float = 120.0
    # How a running sequence gives up its blocks when another's append does not fit (docs/tiers.md):
    # "swap" moves its blocks to its node's host tier and back later (nothing recomputed; falls
    # back to recompute when the host tier is full or absent), "recompute" frees them and
    # recomputes prompt + outputs on re-admission, "auto": swap where the node has a host tier.
    preemption_mode: str = "auto"
    # Ask the nodes for each step's phase timings (GenerateStats; device syncs on a GPU).
    profile_nodes: bool = False
    # Plan and commit step N+1's Step while the nodes run step N (engine.pipeline); False:
    # one step after the other. Default: on, unless PAGEDKV_ASYNC_SCHEDULING=0.
    async_scheduling: bool = field(default_factory=async_scheduling_default)

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_seqs > MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be <= {MAX_NUM_SEQS} (the block manager's items per Step)")
        if self.bm_unavailable_timeout_s < 0:
            raise ValueError("bm_unavailable_timeout_s must be >= 0")


class LLMEngine(StepPlanner, NodePipeline, SwapPreemption):
    """One scheduler over one block manager (`client`) and model nodes (`nodes`, by pool id)."""

    def __init__(
        self,
        client: BlockManagerClient,
        nodes: dict[str, NodeExecutor],
        config: EngineConfig | None = None,
        *,
        detokenize: Any = None,
        connect: Callable[[str, str], NodeExecutor] | None = None,
    ) -> None:
        """`nodes`: the model nodes by pool id. `connect(pool_id, address)`, when given, makes
        an executor for a node the block manager routes to but `nodes` lacks (one registered
        after the engine started) or whose address changed (a node restarted elsewhere): the
        engine adopts it once it serves the same model (`engine.discovery`)."""
        if not nodes:
            raise EngineError("the engine needs at least one model node")
        self.client = client
        self.nodes = nodes
        self.config = config or EngineConfig()
        self.detokenize = detokenize          # token ids -> text, or None
        infos = {nid: node.info() for nid, node in nodes.items()}
        first = next(iter(infos.values()))
        self.model_name = first.model
        self.vocab_size = first.vocab_size
        self._discovery: BackgroundDiscovery | None = None
        if connect is not None:
            self._discovery = BackgroundDiscovery(NodeDiscovery(connect, first.model, first.vocab_size),
                                                  lambda: client.route([0]), lambda: self.nodes)
        for nid, info in infos.items():
            problem = node_problem(info, self.model_name, self.vocab_size)
            if problem is not None:
                raise EngineError(f"node {nid!r} {problem}")
            client.tracker.set_block_size(nid, info.block_size)
        self.eos_token_ids = frozenset(first.eos_token_ids)
        node_len = min(i.max_model_len for i in infos.values())
        self.max_model_len = min(self.config.max_model_len or node_len, node_len)
        self.pool_blocks = {nid: (i.num_blocks, i.block_size) for nid, i in infos.items()}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._to_free: list[str] = []      # ids of finished and preempted admissions, freed with the next Step
        self.swapped: deque[Sequence] = deque()    # SWAPPED, oldest first: swapped back in before new admissions
        self._to_swap_out: list[Sequence] = []     # victims whose swap-out goes with the next Step
        self._swap_step: dict[Sequence, int] = {}  # the step whose Step sent a sequence's swap-out
        self._host_pools: set[str] = set()         # pools with a host tier (their Step answers say so)
        self._changed: set[str] = set()   # requests with news since the last outputs
        self._pool_free: dict[str, tuple[int, int]] = {}   # pool -> (free, usable) blocks, from the last Step
        self._ids = itertools.count()
        self._node_threads: dict[str, ThreadPoolExecutor] = {}   # node -> the thread that calls it (pipeline)
        self.sender = StepSender(self.config.bm_unavailable_timeout_s)
        self._refusals: dict[str, int] = {}   # node -> steps it refused in a row (one thread per node)
        self.health = NodeHealth(self._probe)
        if self._discovery is not None:
            self._discovery.start()
        self._down: frozenset[str] = frozenset()   # nodes out of placement, read once per step
        # async scheduling (engine.pipeline): the step running on the nodes between two calls
        self._flight: InFlight | None = None
        self._launches = itertools.count()   # a unique id for every node step

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; `EngineError` / `InvalidParams` when it can never be served."""
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
        capacity = max(n * bs for n, bs in self.pool_blocks.values())
        if len(ids) + 1 > capacity:
            raise EngineError(f"the prompt needs {len(ids) + 1} KV slots; the largest node holds {capacity}")
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
            self._finish(seq, "abort")
        del self.requests[request_id]   # its blocks go back with the next step (or `flush`)
        self._changed.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.requests)

    def kv_usage(self) -> float:
        """Fraction of the nodes' KV blocks in use (neither free nor evictable), as of the last
        Step answer: every Step answers each pool's free counts, so nothing is polled."""
        total = usable = 0
        for pool_id, (_num_free, num_usable) in self._pool_free.items():
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
        stats = self.stats
        self._down = self.health.down_nodes()
        if self._flight is not None and not self.config.async_scheduling:
            self.drain()   # overlap switched off with a step still running: that one ends first
        flight = self._flight
        if flight is None:   # nothing on the nodes: this step is planned now
            self._adopt_found()
            flight = self._prepare(*self._schedule(None), self._down)
            if flight is not None and self.config.async_scheduling:
                self._launch(flight)
        if flight is not None and self.config.async_scheduling:
            # step N+1's Step and Generates, while the nodes run step N (`flight`)
            following = self._prepare(*self._schedule(flight), self._down)
            self._wait(flight)
            self._adopt_found()   # between two runs of the nodes, never during one
            self._advance(flight, following)
        elif flight is not None:
            self._run(flight)
            self._complete(flight)
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
        self._add_frees(batch)
        swapping_out, swapping_in = self._plan_swaps(batch)
        plan, budget = self._plan_running(batch, self.config.max_num_batched_tokens, flight)
        # sequences waiting on host come back before new admissions
        if not self.swapped:
            plan.admitted = self._plan_admissions(
                batch, budget, len(self.running) + sum(map(len, plan.children_of.values())))
        if (self.swapped or self.waiting) and self.client.pending_reports:
            # Queued work waits on blocks that reports release (a swap-out's, a finished step's):
            # send them even in a Step with nothing else, so the answer's free counts move on.
            batch.flush = True
        t0 = time.perf_counter()
        result = self.sender.commit(batch)
        self.stats.bm_s += time.perf_counter() - t0
        self.stats.num_bm_rpcs += result.num_rpcs
        if result.pool_free:
            self._pool_free = result.pool_free
            self._host_pools = set(result.host_usable)
        self._apply_swaps(result, swapping_out, swapping_in)
        return result.steps, self._apply_step_result(result, plan, flight)

    def _preempt(self, seq: Sequence, *, free: bool) -> None:
        """RUNNING -> PREEMPTED, back to the front of the queue with everything it has as its
        prompt. `free`: its blocks still exist (the id goes out with the next Step); otherwise
        they went with its node."""
        if seq.status is not SeqStatus.RUNNING:
            return
        self.running.remove(seq)
        self.stats.recomputed_tokens += seq.num_computed
        held = seq.preempt()
        if free and held is not None:
            self._to_free.append(held)
        self.waiting.appendleft(seq)

    def _fail_request(self, request: Request, message: str) -> None:
        """The request cannot be served: every completion ends with finish reason "error"."""
        request.error = message
        for seq in request.seqs:
            self._finish(seq, "error")

    def _probe(self, node_id: str) -> str | None:
        """Whether a node out of placement serves again (None) or why not; on `health`'s thread."""
        node = self.nodes.get(node_id)
        if node is None:
            return "no longer known"
        return node_problem(node.info(timeout_s=PROBE_TIMEOUT_S), self.model_name, self.vocab_size)

    def _add_frees(self, batch: Any) -> bool:
        """Move the pending frees into `batch` (which carries them from here on, resent if its
        answer never comes). Whether there were any."""
        freeing, self._to_free = self._to_free, []
        if freeing:
            batch.free(freeing)
        return bool(freeing)

    def _adopt_found(self) -> None:
        """Adopt the nodes the background discovery found (one registered after the engine
        started, or a known pool at a new address): between two runs of the nodes, never
        while a node it replaces is running a step."""
        if self._discovery is None:
            return
        for pool_id, node, info in self._discovery.take():
            self.client.tracker.set_block_size(pool_id, info.block_size)
            self.pool_blocks[pool_id] = (info.num_blocks, info.block_size)
            self.max_model_len = min(self.max_model_len, info.max_model_len)
            previous = self.nodes.get(pool_id)
            if previous is not None:
                previous.close()
            self.nodes[pool_id] = node
            self.health.readmit(pool_id)   # it just answered GetNodeInfo with the engine's model
            self._down = self._down - {pool_id}

    def _accept(self, seq: Sequence, tok: SampledToken, now: float) -> None:
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
        self._changed.add(req.request_id)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            self._finish(seq, "stop")
        elif len(out.token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._changed.add(seq.request.request_id)
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.output.finish_reason is None:
            seq.output.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self._swap_step.pop(seq, None)
            if seq in self._to_swap_out:
                self._to_swap_out.remove(seq)
        held = seq.finish()
        if held is not None:
            self._to_free.append(held)

    # ---- outputs ------------------------------------------------------------------------
    def _collect_outputs(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        changed, self._changed = self._changed, set()
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
                                      req.num_cached_tokens, done, req.error, scored))
            if done:
                del self.requests[rid]
                self.stats.num_finished += 1
        return outs

    def flush(self) -> None:
        """Send the last frees and reports (an idle engine: blocks back, plans can commit).
        With the block manager unreachable they wait for the next step or flush (a Step whose
        answer never came is resent first, under its request id)."""
        self.drain()
        try:
            self.sender.drain(wait=False)
            batch = self.client.step()
            if self._add_frees(batch):
                result = self.sender.commit(batch, wait=False)
                if result.pool_free:
                    self._pool_free = result.pool_free
            elif self.client.pending_reports:
                self.client.flush_reports()
        except UNREACHABLE as exc:
            log.warning("flush_failed", error=str(exc))

    def drain(self) -> None:
        """Wait for the step running on the nodes (async scheduling) and accept its tokens:
        its nodes must write what the block manager gave them before anything is freed. Its
        outputs come with the next `step()`; its failures are acted on as in a step."""
        flight = self._flight
        if flight is not None:
            self._wait(flight)
            self._complete(flight)

    def close(self) -> None:
        """Free what is left, hand the pools back (another scheduler may drive them at once)."""
        try:
            for req in list(self.requests):
                self.abort_request(req)
            self.flush()
            if self.client.held_pools:
                self.client.release()
        except Exception:  # noqa: BLE001 - best effort: leases lapse on their own otherwise
            pass
        self.health.close()
        if self._discovery is not None:
            self._discovery.close()
        for thread in self._node_threads.values():
            thread.shutdown(wait=True)


def generate_all(engine: LLMEngine, requests: Iterable[str]) -> None:
    """Step until every listed request finished."""
    pending = set(requests)
    while pending & set(engine.requests):
        engine.step()


__all__ = ["ASYNC_SCHEDULING_ENV", "EngineConfig", "EngineError", "EngineFailure", "EngineStats", "LLMEngine"]
