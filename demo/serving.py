"""Drive a serving trace through a live block manager and its compute nodes.

This is what a scheduler embedding pagedkv does, step by step: the trace (block_manager's
JSON-lines format) says which requests arrive, fork, decode and finish; the driver turns each
scheduler step into one `Step` against the block manager (reports of the previous Forwards,
frees, allocations, forks, appends — in-block decode appends answered locally) and one
`Forward` per compute node carrying that node's `PoolStep` (copy ops, table deltas) and the
step's new Q/K/V, reports each Forward back with the next step, and checks attention outputs
against a float64 dense reference computed from the same synthetic model — every sequence,
every step by default (`check_every=1`, `check_all=True`): a check that samples hides bugs.

New requests are placed with `Route` (cache-aware: the pool holding the longest cached
prefix, then the emptiest). A request the block manager refuses (out of blocks) is
`rejected`; a sequence whose append fails is `preempted` (freed); later trace ops naming it are
`skipped` — the same accounting as `block-manager replay`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from block_manager.client import BlockManagerClient, StepResult
from block_manager.client.admin import AdminClient
from block_manager.client.types import Admission, ItemFailure
from block_manager.trace.format import AllocateOp, AppendOp, ForkOp, FreeOp, TraceOp
from compute_node.client import ComputeNodeClient, SeqInput
from demo.synthetic import SyntheticModel, extend_hashes, reference_attention
from pagedkv.stats import percentile
from pagedkv.tls import TlsSettings

# fp16 K/V with fp32 accumulation: the kernels' error is a few fp32 ulps of the output norm;
# 2e-3 relative to the output norm leaves room for fp16-rounded queries nowhere (queries are
# fp32) and still catches any wrong block, slot or mask (those give O(1) errors).
REL_TOLERANCE = 2e-3


@dataclass(slots=True)
class _Seq:
    seq_id: str
    node_id: str
    salt: str | None
    hashes: list[int]            # chained hash per position (K/V are a function of it)
    reserved_slots: int          # contiguous baseline: what preallocation would reserve


@dataclass(slots=True)
class StepSample:
    step: int
    wall_s: float
    used_blocks: int | None      # block manager's view (sampled), all pools
    contiguous_blocks: int       # per-sequence max-length preallocation, same live set
    live_seqs: int
    live_tokens: int
    waste_slots: int | None = None   # block manager's (allocated slots - tokens), sampled


@dataclass
class ServingReport:
    steps: list[StepSample] = field(default_factory=list)
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    num_requests: int = 0
    rejected: int = 0
    preempted: int = 0
    skipped: int = 0
    forks: int = 0
    fork_shared_blocks: int = 0  # blocks children shared at fork time (contiguous would copy)
    forwarded_outputs: int = 0    # sequence entries of all Forwards (each one sequence's output)
    checks: int = 0               # sequence outputs compared with the float64 reference (all layers)
    check_policy: str = ""        # which outputs were compared, in words
    check_failures: int = 0
    max_rel_error: float = 0.0
    data_plane_rpcs: int = 0
    route_rpcs: int = 0
    forward_rpcs: int = 0
    node_bm_rpcs: int = 0         # block manager calls the nodes made during Forwards (cold caches)
    deferred_tokens: int = 0
    defrag: dict[str, object] = field(default_factory=dict)
    final_status: dict[str, object] = field(default_factory=dict)
    block_size: int = 0
    num_pool_blocks: int = 0
    swapped_out: int = 0          # sequences the driver swapped out to a host tier (--swap-every)
    swapped_in: int = 0           # ... and back in, onto device blocks, before decoding on
    swap_refused: int = 0         # swap items the block manager refused (host or device full)
    swap_errors: list[str] = field(default_factory=list)   # why, one line each

    def step_latency_ms(self, q: float) -> float:
        if not self.steps:
            return 0.0
        return 1e3 * percentile((s.wall_s for s in self.steps), q)


def _worse(a: float, b: float) -> float:
    """The larger error, NaN (a broken output) counting as the worst."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


class ServingDriver:
    """One scheduler over one block manager and several compute nodes."""

    def __init__(
        self,
        bm_address: str,
        node_addresses: dict[str, str],
        *,
        num_heads: int,
        max_model_len: int,
        check_every: int = 1,
        check_all: bool = True,
        sample_every: int = 5,
        seed: int = 0,
        admin_token: str | None = None,
        forward_timeout_s: float = 120.0,
        scheduler_id: str | None = None,
        tls: TlsSettings | None = None,
        token: str | None = None,
        admin_tls: TlsSettings | None = None,
        swap_every: int = 0,
        swap_count: int = 2,
    ) -> None:
        # Credentials (none: plaintext): the scheduler's `tls` / `token` towards the block
        # manager and the nodes; the admin plane's (`admin_tls`, default `tls`; `admin_token`).
        self.client = BlockManagerClient(bm_address, scheduler_id=scheduler_id, tls=tls, token=token)
        self.admin = AdminClient(bm_address, token=admin_token, tls=admin_tls or tls)
        self.nodes = {
            n: ComputeNodeClient(a, timeout_s=forward_timeout_s, tls=tls, token=token)
            for n, a in node_addresses.items()
        }
        info = next(iter(self.nodes.values())).node_info()
        for node_id in self.nodes:
            # Lets the step helper answer in-block decode appends locally (no round trip).
            self.client.tracker.set_block_size(node_id, info.block_size)
        self.model = SyntheticModel(info.num_layers, num_heads, info.num_kv_heads, info.head_dim, info.dtype, seed=seed)
        self.layers = list(range(info.num_layers))
        self.max_model_len = max_model_len
        self.check_every = check_every
        self.check_all = check_all
        self.sample_every = sample_every
        self.seqs: dict[str, _Seq] = {}
        self.dead: set[str] = set()
        self.report = ServingReport(block_size=info.block_size)
        if not check_every:
            self.report.check_policy = "none"
        elif check_every == 1 and check_all:
            self.report.check_policy = "every sequence, every step"
        else:
            which = "every sequence" if check_all else "2 sequences per node"
            self.report.check_policy = f"{which} every {check_every} steps"
        self._step = 0
        self._pending_free: list[str] = []
        # Forced swaps (docs/tiers.md): every `swap_every` steps the sequences swapped out at
        # the last such step come back and `swap_count` running ones go to their host tier;
        # the trace's appends to a swapped-out sequence are skipped while it is out.
        self.swap_every = swap_every
        self.swap_count = swap_count
        self.swapped: dict[str, _Seq] = {}

    def close(self) -> None:
        """Hand the pools back (another scheduler may drive them at once) and disconnect."""
        try:
            if self.client.held_pools:
                self.client.release()
        except Exception:  # noqa: BLE001 - best effort: the lease lapses on its own otherwise
            pass
        self.client.close()
        self.admin.close()
        for node in self.nodes.values():
            node.close()

    # -- trace -> steps ---------------------------------------------------------------------
    def run(self, ops: Iterable[TraceOp], *, on_step: Callable[[int], None] | None = None,
            defrag_at_step: int | None = None) -> ServingReport:
        """Replay `ops`; a step ends at each `append` op (the trace's scheduler step)."""
        frees: list[str] = []
        allocs: list[AllocateOp] = []
        forks: list[ForkOp] = []
        for op in ops:
            if isinstance(op, FreeOp):
                frees.extend(op.seq_ids)
            elif isinstance(op, AllocateOp):
                allocs.append(op)
            elif isinstance(op, ForkOp):
                forks.append(op)
            elif isinstance(op, AppendOp):
                self._run_step(frees, allocs, forks, op)
                frees, allocs, forks = [], [], []
                if on_step is not None:
                    on_step(self._step)
                if defrag_at_step is not None and self._step == defrag_at_step:
                    self.report.defrag = self.trigger_defrag()
        if frees or allocs or forks:
            self._run_step(frees, allocs, forks, None)
        self._flush_frees()
        self.report.data_plane_rpcs = int(self.client.stats.rpcs) - self.report.route_rpcs
        self.report.deferred_tokens = int(self.client.stats.deferred_tokens)
        self.report.final_status = self.admin.status()
        return self.report

    def _run_step(
        self, frees: list[str], allocs: list[AllocateOp], forks: list[ForkOp], append: AppendOp | None
    ) -> None:
        start = time.perf_counter()
        self._step += 1
        if any(a.seq_id == f.parent_id for a in allocs for f in forks):
            # Parallel sampling forks a freshly admitted request: its prompt K/V must be written
            # (and that Forward reported) before a child's copy-on-write copies the shared
            # partial block, so the prefill runs first (as a real engine does: prefill, sample,
            # then fork the n continuations).
            self._forward(self._commit(frees, allocs, [], None))
            frees, allocs = [], []
        self._forward(self._commit(frees, allocs, forks, append))
        self._sample(time.perf_counter() - start)

    def _commit(
        self, frees: list[str], allocs: list[AllocateOp], forks: list[ForkOp], append: AppendOp | None
    ) -> tuple[StepResult, dict[str, list[tuple[str, int, int]]]]:
        """One Step; returns it with the Forward work (seq, new tokens, context_len)."""
        step = self.client.step()
        freed = [s for s in frees if s in self.seqs or s in self.swapped] + self._pending_free
        self._pending_free = []
        for s in frees:
            if s in self.dead:
                self.dead.discard(s)          # the trace frees a sequence we already dropped
            elif s not in self.seqs:
                self.report.skipped += 1
        if freed:
            step.free(freed)
        routes = self._route_many(allocs)
        for op, pool in zip(allocs, routes):
            self.report.num_requests += 1
            step.allocate(op.seq_id, pool, list(op.token_ids), salt=op.salt)
        allocated = {a.seq_id for a in allocs}
        swap_in, swap_out = self._plan_swaps(set(freed), {f.parent_id for f in forks})
        if swap_in:
            step.swap_in(swap_in)
        if swap_out:
            step.swap_out(swap_out)
        for op in forks:
            if op.parent_id in self.seqs or op.parent_id in allocated:
                step.fork(op.parent_id, list(op.child_ids))
            else:
                self.report.skipped += 1
                self.dead.update(op.child_ids)
        born = {c for f in forks for c in f.child_ids}
        if append is not None:
            for seq_id, token_ids in append.seqs:
                if seq_id in self.swapped or seq_id in swap_out:
                    continue   # out on the host tier this step: it decodes on once swapped in
                if seq_id in self.seqs or seq_id in allocated or seq_id in born:
                    step.append(seq_id, list(token_ids))
                else:
                    self.report.skipped += 1
        # Per-item failures (out of blocks, a parent the block manager refused) come back in
        # the result; only whole-RPC errors raise.
        result = step.commit()
        work: dict[str, list[tuple[str, int, int]]] = {}
        for s in freed:
            self.seqs.pop(s, None)
            self.swapped.pop(s, None)
        self._swap_results(result)
        for sid in result.dropped:  # a reported failure dropped them: their requests restart
            if self.seqs.pop(sid, None) is not None:
                self.report.preempted += 1
                self.dead.add(sid)
        for op in allocs:
            out = result.allocations.get(op.seq_id)
            if isinstance(out, Admission):
                seq = _Seq(op.seq_id, out.pool_id, op.salt, [], self._reservation(len(op.token_ids)))
                extend_hashes(seq.hashes, op.token_ids, op.salt)
                self.seqs[op.seq_id] = seq
                self.report.prefill_tokens += len(op.token_ids)
                self.report.cached_tokens += out.num_cached_tokens
                n = out.num_tokens - out.num_cached_tokens
                work.setdefault(out.pool_id, []).append((op.seq_id, n, out.num_tokens))
            else:
                self.report.rejected += 1
                self.dead.add(op.seq_id)
        for parent, children in result.forks.items():
            if isinstance(children, ItemFailure):
                self.dead.update(next(f.child_ids for f in forks if f.parent_id == parent))
                continue
            p = self.seqs[parent]
            for c in children:
                self.seqs[c] = _Seq(c, p.node_id, p.salt, list(p.hashes), p.reserved_slots)
                self.report.forks += 1
                self.report.fork_shared_blocks += -(-len(p.hashes) // self.report.block_size)
        for seq_id, token_ids in (append.seqs if append is not None else ()):
            if seq_id in swap_out:
                continue
            out = result.appends.get(seq_id)
            if out is None or seq_id not in self.seqs:
                continue
            if isinstance(out, ItemFailure):
                self.report.preempted += 1
                self.seqs.pop(seq_id)
                self._pending_free.append(seq_id)
                self.dead.add(seq_id)
                continue
            seq = self.seqs[seq_id]
            extend_hashes(seq.hashes, token_ids, seq.salt)
            self.report.generated_tokens += len(token_ids)
            # A sequence allocated and appended in the same step writes both in one Forward.
            parts = work.setdefault(seq.node_id, [])
            prior = next((i for i, p in enumerate(parts) if p[0] == seq_id), None)
            if prior is None:
                parts.append((seq_id, out.num_new_tokens, out.context_len))
            else:
                parts[prior] = (seq_id, parts[prior][1] + out.num_new_tokens, out.context_len)
        return result, work

    def _plan_swaps(self, freed: set[str], parents: set[str]) -> tuple[list[str], list[str]]:
        """At every `swap_every`-th step: bring back what is out, send `swap_count` others out
        (never one the step frees or forks)."""
        if not self.swap_every or self._step % self.swap_every:
            return [], []
        swap_in = [s for s in self.swapped if s not in freed]
        running = [s for s in self.seqs if s not in freed and s not in parents]
        return swap_in, running[: self.swap_count]

    def _swap_results(self, result: StepResult) -> None:
        for sid, err in result.swapped_out.items():
            if err is not None:
                self.report.swap_refused += 1
                self.report.swap_errors.append(str(err))
            elif sid in self.seqs:
                self.swapped[sid] = self.seqs.pop(sid)
                self.report.swapped_out += 1
        for sid, out in result.swapped_in.items():
            if isinstance(out, ItemFailure):
                self.report.swap_errors.append(str(out))
                self.report.swap_refused += 1   # still out: tried again at the next swap step
                continue
            seq = self.swapped.pop(sid, None)
            if seq is None:
                continue
            if out != len(seq.hashes):   # the block manager must bring back every token it had
                self.report.check_failures += 1
            self.seqs[sid] = seq
            self.report.swapped_in += 1

    def _route_many(self, allocs: list[AllocateOp]) -> list[str]:
        """Cache-aware placement of every admission of the step, in one batched Route."""
        if not allocs:
            return []
        self.report.route_rpcs += 1
        ranked = self.client.route_many([(list(op.token_ids), op.salt) for op in allocs])
        fallback = next(iter(self.nodes))
        return [next((r.pool_id for r in routes if r.pool_id in self.nodes), fallback) for routes in ranked]

    def _reservation(self, prompt_len: int) -> int:
        return max(self.max_model_len, prompt_len)

    # -- compute -------------------------------------------------------------------------------
    def _forward(self, step_work: tuple[StepResult, dict[str, list[tuple[str, int, int]]]]) -> None:
        """One Forward per node: the node's PoolStep (if the step has one) and its sequences'
        new Q/K/V; each Forward is reported back with the next step."""
        result, work = step_work
        for node_id in sorted(set(work) | set(result.steps)):
            items = [(sid, n, ctx) for sid, n, ctx in work.get(node_id, []) if n > 0]
            inputs = []
            for seq_id, n, context_len in items:
                seq = self.seqs[seq_id]
                k, v = self.model.kv(seq.hashes[context_len - n : context_len])
                inputs.append(SeqInput(seq_id, context_len, self.model.queries(n), k, v))
            pool_step = result.steps.get(node_id)
            try:
                out = self.nodes[node_id].forward(
                    inputs, self.layers, steps=[pool_step.message] if pool_step else [], scale=self.model.scale
                )
            except Exception:
                if pool_step is not None:
                    self.client.report(pool_step, ok=False)
                raise
            if pool_step is not None:
                self.client.report(pool_step, ok=True)
            self.report.forward_rpcs += 1
            self.report.forwarded_outputs += len(inputs)
            self.report.node_bm_rpcs += int(out.stats.num_block_manager_rpcs)
            if self.check_every and self._step % self.check_every == 0:
                checked = list(zip(inputs, out.outputs))
                for inp, got in checked if self.check_all else checked[:2]:
                    self._check(inp.seq_id, inp, got)

    def _check(self, seq_id: str, inp: SeqInput, got: np.ndarray) -> None:
        seq = self.seqs[seq_id]
        k, v = self.model.kv(seq.hashes[: inp.context_len])
        worst = 0.0
        for li in range(len(self.layers)):
            want = reference_attention(inp.query[li], k[li], v[li], self.model.scale)
            err = float(np.linalg.norm(got[li].astype(np.float64) - want) / max(np.linalg.norm(want), 1e-12))
            worst = _worse(worst, err)
        self.report.checks += 1
        self.report.max_rel_error = _worse(self.report.max_rel_error, worst)
        if not worst <= REL_TOLERANCE:
            self.report.check_failures += 1

    def _sample(self, wall: float) -> None:
        d = self.report.defrag
        if d and "high_water_after" not in d and self._step > int(d["step"]):
            # The plan commits once the Forward carrying its copies is reported (the step after
            # next); read the mark as soon as no block is reserved any more.
            pools = self.admin.status()["pools"]
            if all(int(p["num_reserved_blocks"]) == 0 for p in pools):
                d["high_water_after"] = {p["pool_id"]: int(p["high_water_mark"]) for p in pools}
                d["moves"] = sum(int(p["defrag_moves"]) for p in pools) - int(d["moves_before"])
                d["after_step"] = self._step
        used = waste = None
        if self.sample_every and self._step % self.sample_every == 0:
            status = self.admin.status()
            used = sum(int(p["num_used_blocks"]) for p in status.get("pools", []))
            waste = sum(int(p.get("waste_slots", 0)) for p in status.get("pools", []))
            self.report.num_pool_blocks = sum(int(p["num_blocks"]) for p in status.get("pools", []))
        bs = self.report.block_size
        contiguous = sum(-(-s.reserved_slots // bs) for s in self.seqs.values())
        tokens = sum(len(s.hashes) for s in self.seqs.values())
        self.report.steps.append(StepSample(self._step, wall, used, contiguous, len(self.seqs), tokens, waste))

    def _flush_frees(self) -> None:
        """Free what the trace left running (and preempted sequences not yet freed)."""
        leftover = list(self.seqs) + list(self.swapped) + self._pending_free
        if leftover:
            self.client.free(leftover)
        else:
            self.client.flush_reports()
        self.seqs.clear()
        self.swapped.clear()
        self._pending_free = []

    # -- admin ---------------------------------------------------------------------------------
    def trigger_defrag(self) -> dict[str, object]:
        """Admin-triggered compaction: the plan rides in each pool's next step and commits when
        that step's Forward is reported."""
        pools = self.admin.status()["pools"]
        before = {p["pool_id"]: int(p["high_water_mark"]) for p in pools}
        moves_before = sum(int(p["defrag_moves"]) for p in pools)
        reply = self.admin.trigger_defrag("", "compaction")
        return {"step": self._step, "high_water_before": before, "moves_before": moves_before, "trigger": reply}
