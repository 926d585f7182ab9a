"""The engine: continuous batching over the block manager and the model nodes, one step at a time.

Each `step()`:

1. plans the step under a token budget (`max_num_batched_tokens`) and a sequence cap
   (`max_num_seqs`): running sequences first (a decode token each, or the next chunk of a
   long prompt: chunked prefill), forks of `n > 1` requests whose shared prompt is computed,
   then new requests in arrival order, as placed allocations: the block manager picks each
   one's node (cached prefix, then free blocks) inside the same Step, within the budget;
2. sends ONE `Step` to the block manager (frees of finished and preempted sequences, the
   reports of the previous step's Forwards, admissions, forks, appends with their token ids
   so generated text is prefix-cached too; in-block decode appends are answered by the
   client library without a round trip);
3. sends each node one `Generate` carrying that node's `PoolStep` (copy ops and table deltas
   to apply first) and its sequences' new token ids; nodes run in parallel (data parallel:
   every node holds a full model replica);
4. reports every Forward with the next step, appends the sampled tokens, applies stop rules
   and returns what changed.

What happens when part of a step fails is one table, `engine.failure_policy` (item kind x
typed error -> action), and a sequence's states and transitions are in one place,
`engine.sequence` (WAITING, FORKING, RUNNING, PREEMPTED, FINISHED). In short: an admission
that does not fit waits; a running sequence whose append does not fit preempts the most
recently admitted running sequence (possibly itself: freed, re-queued at the front, later
recomputing everything it had); a node that fails a step has its step reported failed (the
block manager drops what that step wrote) and its sequences recomputed, and a node that does
not answer leaves placement until a probe finds it back (`engine.health`).

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

from block_manager.client import BlockManagerClient, ItemFailure, PoolStepInfo, StepResult
from engine.bm_steps import UNREACHABLE, StepSender
from engine.discovery import BackgroundDiscovery, NodeDiscovery, node_problem
from engine.errors import EngineError, EngineFailure, NodeError, NodeMovedOn
from engine.failure_policy import MAX_REFUSALS_IN_A_ROW, Action, Item, action_for
from engine.health import NodeHealth
from engine.node_api import NodeExecutor, NodeStep, SampledToken, SamplingSpec, SeqStep
from engine.params import CompletionOutput, InvalidParams, RequestOutput, SamplingParams
from engine.sequence import Request, SeqStatus, Sequence
from pagedkv.logging import get_logger
from pagedkv.seeds import derive_seed
from pagedkv.stats import percentile

STAT_WINDOW = 100_000
NO_CAPACITY_WAIT_S = 0.05    # a step that could run nothing sleeps this long before the next
# Admission sizes that keep every Step inside what the block manager accepts (4096 items and
# 64 MiB by default) without resending the whole queue every step.
MAX_ADMISSIONS_PER_STEP = 256
ADMIT_IDS_PER_BUDGET_TOKEN = 8    # prompt token ids sent for admission per token of budget
MAX_NUM_SEQS = 4096               # a Step's appends (one per running sequence) stay within its item limit
MAX_STEP_TOKEN_IDS = 1 << 20      # admitted prompt token ids one Step carries (one admission at least)
PROBE_TIMEOUT_S = 2.0        # GetNodeInfo of a node out of placement (on the probing thread)
NODE_THREADS = 64            # most nodes generating at once (threads start only as needed)
log = get_logger("engine.llm_engine")


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

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_seqs > MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be <= {MAX_NUM_SEQS} (the block manager's items per Step)")
        if self.bm_unavailable_timeout_s < 0:
            raise ValueError("bm_unavailable_timeout_s must be >= 0")


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (the API server exports them)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_failed_steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    num_finished: int = 0
    # recent samples only (a long-running server must not grow without bound)
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=STAT_WINDOW))   # arrival → first token
    itl_s: deque[float] = field(default_factory=lambda: deque(maxlen=STAT_WINDOW))    # between tokens
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=STAT_WINDOW))
    bm_s: float = 0.0          # time in block manager calls (the Step)
    num_bm_rpcs: int = 0       # block manager round trips made by steps
    node_s: float = 0.0        # time in Generate calls (wall, nodes in parallel)
    # host tier (docs/tiers.md): sequences swapped out / in, swap-outs that fell back to
    # recompute, tokens recomputed by recompute preemption, and the tier moves the nodes ran
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    recompute_fallbacks: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    host_hit_tokens: int = 0
    # disk tier (docs/tiers.md): host blocks spilled to disk, blocks / prompt tokens onboarded
    # from disk (disk->host->device; not in host_hit_tokens)
    disk_offloaded_blocks: int = 0
    disk_onboarded_blocks: int = 0
    disk_hit_tokens: int = 0
    # prefix fetch (docs/prefix_fetch.md): prompt tokens admitted as blocks pulled from another node
    fetched_tokens: int = 0

    def summary(self) -> dict[str, float]:
        """Counters and latency percentiles (ms) as a flat mapping."""
        def p(xs: deque[float], q: float) -> float:
            return 1e3 * percentile(xs, q) if xs else 0.0

        return {
            "steps": self.num_steps, "preemptions": self.num_preemptions,
            "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_hit_tokens": (self.cached_prompt_tokens - self.host_hit_tokens - self.disk_hit_tokens
                                  - self.fetched_tokens),
            "fetched_tokens": self.fetched_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "disk_offloaded_blocks": self.disk_offloaded_blocks, "disk_onboarded_blocks": self.disk_onboarded_blocks,
            "disk_hit_tokens": self.disk_hit_tokens,
            "swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks,
            "offloaded_blocks": self.offloaded_blocks, "onboarded_blocks": self.onboarded_blocks,
            "recomputed_tokens": self.recomputed_tokens, "recompute_fallbacks": self.recompute_fallbacks,
            "swap_outs": self.num_swap_outs, "swap_ins": self.num_swap_ins,
            "ttft_p50_ms": p(self.ttft_s, 50), "ttft_p99_ms": p(self.ttft_s, 99),
            "itl_p50_ms": p(self.itl_s, 50), "itl_p99_ms": p(self.itl_s, 99),
        }


@dataclass(slots=True)
class _Work:
    """One sequence's share of a node's Generate this step."""

    seq: Sequence
    token_ids: list[int]
    context_len: int
    sample: bool


class LLMEngine:
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
        self._pool: ThreadPoolExecutor | None = None   # made when a step first spans two nodes
        self.sender = StepSender(self.config.bm_unavailable_timeout_s)
        self._refusals: dict[str, int] = {}   # node -> steps it refused in a row (one thread per node)
        self.health = NodeHealth(self._probe)
        if self._discovery is not None:
            self._discovery.start()
        self._down: frozenset[str] = frozenset()   # nodes out of placement, read once per step

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
        """Run one scheduler step; the outputs of the requests that changed."""
        started = time.perf_counter()
        if self._discovery is not None:
            self._adopt(self._discovery.take())
        self._down = self.health.down_nodes()
        self.sender.drain(wait=True)
        batch = self.client.step()
        self._add_frees(batch)
        swapping_out, swapping_in = self._plan_swaps(batch)
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Sequence, int]] = []     # (seq, tokens to compute) for appends
        forks: list[Sequence] = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.fork_parent and seq.num_computed == seq.prefill_target:
                forks.append(seq)
                continue
            n = min(len(seq.token_ids) - seq.num_computed, seq.prefill_target - seq.num_computed
                    if seq.num_computed < seq.prefill_target else 1, budget)
            if n <= 0:
                continue
            batch.append(seq.seq_id, seq.token_ids[seq.num_computed : seq.num_computed + n])
            planned.append((seq, n))
            budget -= n
        children_of: dict[Sequence, list[tuple[Sequence, str]]] = {}
        for parent in forks:
            kids = [(s, s.new_admission_id()) for s in parent.request.seqs if s.status is SeqStatus.FORKING]
            batch.fork(parent.seq_id, [kid_id for _, kid_id in kids])
            children_of[parent] = kids
            # each computes the last prompt token and samples
            batch.append(parent.seq_id, [parent.token_ids[-1]])
            for _, kid_id in kids:
                batch.append(kid_id, [parent.token_ids[-1]])
            budget -= 1 + len(kids)
        # sequences waiting on host come back before new admissions
        admitted = [] if self.swapped else self._plan_admissions(
            batch, budget, len(self.running) + sum(map(len, children_of.values())))
        t0 = time.perf_counter()
        result = self.sender.commit(batch)
        self.stats.bm_s += time.perf_counter() - t0
        self.stats.num_bm_rpcs += result.num_rpcs
        if result.pool_free:
            self._pool_free = result.pool_free
            self._host_pools = set(result.host_usable)
        self._apply_swaps(result, swapping_out, swapping_in)
        work = self._apply_step_result(result, planned, children_of, admitted)
        self._run_nodes(result, work)
        if not work and not self.running and self.waiting:
            # nothing could be admitted (no node admits sequences now: fenced, draining, full):
            # wait a little rather than spin on empty Steps
            time.sleep(NO_CAPACITY_WAIT_S)
        self.stats.num_steps += 1
        self.stats.step_s.append(time.perf_counter() - started)
        return self._collect_outputs()

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
            batch.allocate(seq_id, None, tokens)
            admitted.append((seq, seq_id))
            carried += len(tokens)
        return admitted

    def _apply_step_result(
        self,
        result: StepResult,
        planned: list[tuple[Sequence, int]],
        children_of: dict[Sequence, list[tuple[Sequence, str]]],
        admitted: list[tuple[Sequence, str]],
    ) -> dict[str, list[_Work]]:
        """What the block manager's answer means for each item: the step's work per node, and
        for each refused item the failure table's action (`engine.failure_policy`)."""
        work: dict[str, list[_Work]] = {}

        def add(seq: Sequence, start: int, end: int) -> None:
            # a sequence samples once its whole prompt is computed (a fork parent stops one short)
            item = _Work(seq, seq.token_ids[start:end], end, end >= seq.num_prompt)
            work.setdefault(seq.node_id or "", []).append(item)

        dropped = set(result.dropped)
        for seq in list(self.running):
            if seq.seq_id in dropped:
                self._preempt(seq, free=False)   # its node's epoch ended: nothing left to free
        starved: list[Sequence] = []   # appends out of blocks: each preempts someone
        for seq, n in planned:
            out = result.appends.get(seq.seq_id or "")
            if isinstance(out, ItemFailure):
                self._append_failed(seq, out, starved)
            elif out is not None:
                add(seq, seq.num_computed, seq.num_computed + n)
        for parent, kids in children_of.items():
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
        for seq, seq_id in admitted:
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
        """Free the most recently admitted running sequences without work in this step, one
        per starved append (a starved sequence, whose append changed nothing, may be its own
        victim); they recompute later. A sequence with work this step is never a victim: its
        step's slots are assigned, so its Forward must write them."""
        for _ in starved:
            victims = [s for s in self.running if s not in busy]
            if not victims:
                return
            self.stats.num_preemptions += 1
            self._preempt_victim(victims[-1])

    # ---- swap preemption (host tier, docs/tiers.md) ----------------------------------------
    def _swaps_to(self, node_id: str | None) -> bool:
        mode = self.config.preemption_mode
        return mode == "swap" or (mode == "auto" and node_id in self._host_pools)

    def _preempt_victim(self, seq: Sequence) -> None:
        """Preempt `seq` for a starved append: to its node's host tier (its swap-out goes with
        the next Step), or by recompute."""
        if not self._swaps_to(seq.node_id):
            self._preempt(seq, free=True)
            return
        self.running.remove(seq)
        seq.swap_out()
        self.swapped.append(seq)
        self._to_swap_out.append(seq)

    def _plan_swaps(self, batch: Any) -> tuple[list[Sequence], list[Sequence]]:
        """This Step's swap-outs (last step's victims) and swap-ins: the oldest swapped-out
        sequences whose swap-out step ran, while their node has the blocks to spare."""
        out, self._to_swap_out = self._to_swap_out, []
        if out:
            batch.swap_out([s.seq_id for s in out])
            for s in out:
                self._swap_step[s] = self.stats.num_steps
        usable = {pid: u for pid, (_f, u) in self._pool_free.items()}
        for seq in [s for s in self.swapped if s.seq_id not in {o.seq_id for o in out}
                    and (s.node_id in self._down or (usable and s.node_id not in usable))]:
            # its node left placement or its pool is gone: it cannot come back from that host tier
            self._recompute_swapped(seq, free=seq.node_id in usable)
        back: list[Sequence] = []
        for seq in self.swapped:
            if self._swap_step.get(seq, self.stats.num_steps) >= self.stats.num_steps:
                break   # swapped out by this very Step (or not sent yet): its host copy is not written
            bs = self.pool_blocks.get(seq.node_id or "", (0, 1))[1]
            need = -(-seq.num_computed // bs) + 1   # its blocks, and one to grow into
            if usable.get(seq.node_id or "", 0) < need + len(back):
                break   # oldest first: a later one does not overtake it
            usable[seq.node_id or ""] = usable.get(seq.node_id or "", 0) - need
            back.append(seq)
        if back:
            batch.swap_in([s.seq_id for s in back])
        return out, back

    def _apply_swaps(self, result: StepResult, out: list[Sequence], back: list[Sequence]) -> None:
        """The Step's answer for swaps: a swap-out refused (host tier full or absent) falls back
        to recompute (its blocks are still on device: freed with the next Step); a swap-in done
        resumes the sequence (its next token next step); one refused for lack of room or an
        unreported swap-out waits; a swapped sequence the block manager dropped (the step that
        carried its swap-out failed) recomputes."""
        for seq in out:
            if seq.status is not SeqStatus.SWAPPED:
                continue
            failure = result.swapped_out.get(seq.seq_id or "")
            if isinstance(failure, ItemFailure):
                log.info("swap_out_refused", seq_id=seq.seq_id, error=str(failure.error))
                self._recompute_swapped(seq, free=True)
            else:
                self.stats.num_swap_outs += 1
        for seq in back:
            answer = result.swapped_in.get(seq.seq_id or "")
            if isinstance(answer, int):
                self.swapped.remove(seq)
                self._swap_step.pop(seq, None)
                seq.swap_in()
                self.running.append(seq)
                self.stats.num_swap_ins += 1
            elif isinstance(answer, ItemFailure) and answer.error.reason not in ("OutOfBlocks", "PendingWrite"):
                self._recompute_swapped(seq, free=False)
        for seq in [s for s in self.swapped if s.seq_id in result.dropped]:
            self._recompute_swapped(seq, free=False)
        for info in result.steps.values():
            for f in info.message.fetches:   # prefix fetch: pulled by the node instead of recomputed
                self.stats.fetched_tokens += len(f.token_ids)
            kinds = list(info.message.tier_kind)
            if kinds:
                bs = self.pool_blocks.get(info.pool_id, (0, 1))[1]
                self.stats.swapped_out_blocks += kinds.count(1)
                self.stats.swapped_in_blocks += kinds.count(2)
                self.stats.offloaded_blocks += kinds.count(3)
                self.stats.onboarded_blocks += kinds.count(4)
                from_disk = kinds.count(6)   # each also onboarded host->device (kind 4)
                self.stats.host_hit_tokens += (kinds.count(4) - from_disk) * bs
                self.stats.disk_offloaded_blocks += kinds.count(5)
                self.stats.disk_onboarded_blocks += from_disk
                self.stats.disk_hit_tokens += from_disk * bs

    def _recompute_swapped(self, seq: Sequence, *, free: bool) -> None:
        """A swapped sequence that cannot come back from host: recompute it (fallback)."""
        self.swapped.remove(seq)
        self._swap_step.pop(seq, None)
        self.stats.recompute_fallbacks += 1
        self.stats.recomputed_tokens += seq.num_computed
        held = seq.preempt()
        if free and held is not None:
            self._to_free.append(held)
        self.waiting.appendleft(seq)

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

    # ---- the nodes ----------------------------------------------------------------------
    def _run_nodes(self, result: StepResult, work: dict[str, list[_Work]]) -> None:
        jobs: list[tuple[str, NodeStep, PoolStepInfo | None, list[_Work]]] = []
        for node_id in sorted(set(work) | set(result.steps)):
            items = [w for w in work.get(node_id, []) if w.seq.status is SeqStatus.RUNNING]
            info = result.steps.get(node_id)
            step = NodeStep(f"{node_id}-{self.stats.num_steps}-{id(self)}", [info] if info is not None else [],
                            [SeqStep(w.seq.seq_id or "", w.token_ids, w.context_len, w.seq.num_output_tokens,
                                     _sampling(w.seq) if w.sample else None) for w in items],
                            profile=self.config.profile_nodes)
            jobs.append((node_id, step, info, items))
        t0 = time.perf_counter()
        live = [job for job in jobs if job[0] not in self._down]   # a node out of placement is not called
        if len(live) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=NODE_THREADS, thread_name_prefix="generate")
            futures = {node_id: self._pool.submit(self._generate, node_id, step) for node_id, step, _, _ in live}
            answers = {node_id: f.result() for node_id, f in futures.items()}
        else:
            answers = {node_id: self._generate(node_id, step) for node_id, step, _, _ in live}
        self.stats.node_s += time.perf_counter() - t0
        now = time.perf_counter()
        for node_id, _step, info, items in jobs:
            answer = answers.get(node_id)
            failed = answer is None or isinstance(answer, NodeError)
            action = self._node_action(node_id, answer) if isinstance(answer, NodeError) else None
            if info is not None:
                self.client.report(info, not failed)
            if failed:
                if answer is not None:
                    self.stats.num_failed_steps += 1
                for w in items:
                    # The failed report drops the step's writers; the others (their tokens were
                    # answered locally) are freed: the Step skips frees of what it just dropped.
                    self._preempt(w.seq, free=True)
                if action is Action.TAKE_NODE_OUT:
                    self._take_out(node_id, str(answer))
                continue
            tokens = iter(answer)   # type: ignore[arg-type]
            for w in items:
                w.seq.num_computed = w.context_len
                if w.sample:
                    self._accept(w.seq, next(tokens), now)

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

    def _adopt(self, found: Iterable[tuple[str, NodeExecutor, Any]]) -> None:
        """Adopt the nodes the background discovery found (one registered after the engine
        started, or a known pool at a new address): between steps, never in the middle."""
        for pool_id, node, info in found:
            self.client.tracker.set_block_size(pool_id, info.block_size)
            self.pool_blocks[pool_id] = (info.num_blocks, info.block_size)
            self.max_model_len = min(self.max_model_len, info.max_model_len)
            previous = self.nodes.get(pool_id)
            if previous is not None:
                previous.close()
            self.nodes[pool_id] = node
            self.health.readmit(pool_id)   # it just answered GetNodeInfo with the engine's model
            self._down = self._down - {pool_id}

    def _generate(self, node_id: str, step: NodeStep) -> list[SampledToken] | NodeError:
        """The node's tokens, or its typed failure (acted on by the engine thread)."""
        try:
            tokens = self.nodes[node_id].generate(step)
        except NodeError as exc:
            return exc
        self._refusals[node_id] = 0
        return tokens

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
            outs.append(RequestOutput(rid, req.prompt, req.prompt_token_ids, req.outputs,
                                      req.num_cached_tokens, done, req.error))
            if done:
                del self.requests[rid]
                self.stats.num_finished += 1
        return outs

    def flush(self) -> None:
        """Send the last frees and reports (an idle engine: blocks back, plans can commit).
        With the block manager unreachable they wait for the next step or flush (a Step whose
        answer never came is resent first, under its request id)."""
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _sampling(seq: Sequence) -> SamplingSpec:
    p = seq.request.params
    return SamplingSpec(p.temperature, p.top_p, p.top_k or 0, p.min_p, seq.seed, p.logprobs)


def generate_all(engine: LLMEngine, requests: Iterable[str]) -> None:
    """Step until every listed request finished."""
    pending = set(requests)
    while pending & set(engine.requests):
        engine.step()


__all__ = ["EngineConfig", "EngineError", "EngineFailure", "EngineStats", "LLMEngine"]
