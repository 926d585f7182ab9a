"""Replay a JSON-lines trace through the block manager core and measure it.

The replay is the benchmark harness of the core and a debugging tool for traces recorded
elsewhere: it drives one `BlockManager` pool exactly as a scheduler would and reports memory
and latency numbers. Memory pressure is resolved the simple way a scheduler without a
recompute queue would:

- an `allocate` that does not fit (`OutOfBlocks`, watermark included) is **rejected**;
- a sequence whose `append` does not fit is freed and **preempted**;
- a `fork` whose children cannot be created is **rejected** once per child (the core's fork
  only shares blocks and does not run out today; the rule is there for cores that reserve);
- later ops naming a rejected/preempted sequence (or a child of a rejected or skipped fork)
  are **skipped**: one skip per occurrence of such a name. In a batched `append`/`free` the
  dead names are dropped from the batch (one skip each) and the rest runs as one call; a
  `fork` of a dead parent counts one skip and its children become dead as well. A `free` of a
  dead name forgets it, so the id may be allocated again later.

Ops that name a sequence the trace never allocated (or already freed), or that allocate a
live id, are trace errors (`TraceError` with the line number), not memory events.

`contiguous_*` numbers describe the baseline without paging: every admitted sequence reserves
one contiguous region at admission, forked samples included (no sharing without pages). By
default the region is its whole lifetime length (`prompt + all tokens it will ever append`,
known from a pre-pass over the trace): the most favourable case contiguous preallocation can
get. `max_output_len` reserves `tokens at admission + max_output_len` instead, and
`max_model_len` reserves `max_model_len` (what real servers without paging do); neither ever
reserves less than the sequence really needs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import ParamSpec, TypeVar

from block_manager.core.errors import CoreError, OutOfBlocks, PendingWrite
from block_manager.core.manager import BlockManager
from block_manager.core.types import AppendFailure, AppendRequest, AppendResult, PoolId, SeqId
from block_manager.trace.format import (
    AllocateOp,
    AppendOp,
    ForkOp,
    FreeOp,
    TraceError,
    TraceOp,
    parse_trace,
)
from pagedkv.stats import percentile

REPLAY_POOL = PoolId("replay")

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(slots=True)
class ReplayReport:
    """Metrics of one replay. Times are in seconds / microseconds as named."""

    ops: int
    wall_s: float  # whole replay: core calls, metric sampling, bookkeeping (parsing excluded)
    core_s: float  # time inside mutating core calls only
    ops_per_s: float  # ops / core_s: the core's throughput on this trace
    append_step_p50_us: float
    append_step_p99_us: float
    append_step_max_us: float
    num_append_steps: int
    mean_append_batch: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_blocks: int
    block_size: int
    peak_used_blocks: int
    mean_used_blocks: float  # over append steps
    cow_copies: int
    evictions: int
    rejected: int
    preempted: int
    skipped: int
    waste_ratio: float  # mean over append steps of (allocated slots - tokens) / allocated slots
    peak_concurrency: int  # most live sequences at once
    mean_concurrency: float  # over append steps
    contiguous_baseline_blocks: int  # peak of the contiguous reservation, in blocks
    contiguous_mean_blocks: float  # mean over append steps
    concurrency_gain: float  # contiguous slots per live sequence / paged slots per live sequence
    contiguous_waste_ratio: float  # mean over append steps of (reserved - tokens) / reserved
    concurrency_gain_exact: float  # the same gain against the exact-length (oracle) baseline
    fsck_problems: list[str] = field(default_factory=list)
    # host tier (`host_blocks`; docs/tiers.md): a preempted sequence is swapped out and back in
    # before its next append that finds room (its appends meanwhile are skipped; recompute only
    # when the host tier is full); offload / onboard as the core does them. `preemptions`
    # counts both kinds, `recomputed_tokens` only recomputes.
    host_blocks: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    host_hit_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(slots=True)
class _Live:
    """The replay's own view of a live sequence, built only from the core's results."""

    num_tokens: int
    block_table: list[int]
    reserved_slots: int  # contiguous-baseline reservation of this sequence
    exact_slots: int  # its exact lifetime length (the oracle baseline)


def _lifetime_lengths(ops: list[TraceOp]) -> dict[tuple[int, SeqId], int]:
    """Final length of every sequence instance, keyed by (line of its allocate/fork, id).

    Computed as scheduled (ignoring rejections), which is what a contiguous allocator would
    have to reserve for it. Inconsistent names are left to the replay to report.
    """
    num_tokens: dict[SeqId, int] = {}
    instance: dict[SeqId, tuple[int, SeqId]] = {}
    final: dict[tuple[int, SeqId], int] = {}

    def close(seq_id: SeqId) -> None:
        if seq_id in instance:
            final[instance.pop(seq_id)] = num_tokens.pop(seq_id)

    for op in ops:
        if isinstance(op, AllocateOp):
            close(op.seq_id)
            num_tokens[op.seq_id] = len(op.token_ids)
            instance[op.seq_id] = (op.line_no, op.seq_id)
        elif isinstance(op, AppendOp):
            for seq_id, token_ids in op.seqs:
                if seq_id in num_tokens:
                    num_tokens[seq_id] += len(token_ids)
        elif isinstance(op, ForkOp):
            for child_id in op.child_ids:
                close(child_id)
                num_tokens[child_id] = num_tokens.get(op.parent_id, 0)
                instance[child_id] = (op.line_no, child_id)
        else:
            for seq_id in op.seq_ids:
                close(seq_id)
    for seq_id in list(instance):
        close(seq_id)
    return final


class TraceReplayer:
    """Replays parsed trace ops through one pool of a fresh `BlockManager`."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        max_model_len: int | None = None,
        max_output_len: int | None = None,
        host_blocks: int = 0,
    ) -> None:
        self.manager = BlockManager(watermark=watermark, enable_prefix_caching=enable_prefix_caching)
        self.manager.add_pool(REPLAY_POOL, num_blocks, block_size, host_num_blocks=host_blocks)
        self.host_blocks = host_blocks
        self.swapped: dict[SeqId, _Live] = {}   # swapped out to the host tier, swapped in on their next append
        self.recomputed_tokens = 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_output_len = max_output_len
        self.live: dict[SeqId, _Live] = {}
        # Block -> number of live tables holding it, rebuilt from results the way a client
        # sees them. It gives usage and waste per step in O(batch) (the core's `metrics()`
        # walks every sequence) and is cross-checked against the core at the end.
        self.ref_cnt: dict[int, int] = {}
        self.dead: set[SeqId] = set()  # rejected / preempted, not yet freed by the trace
        self.lifetimes: dict[tuple[int, SeqId], int] = {}
        self.core_ns = 0
        self.append_step_ns: list[int] = []
        self.append_batch_sizes: list[int] = []
        self.rejected = self.preempted = self.skipped = 0
        self.peak_used_blocks = 0
        self.peak_concurrency = 0
        self.contiguous_slots = 0  # current sum of reservations of live sequences
        self.live_tokens = 0  # current sum of tokens of live sequences (shared ones counted per seq)
        self.peak_contiguous_slots = 0
        self.exact_slots = 0  # the same sum for the exact-length baseline
        self.exact_samples: list[int] = []
        # Per append step samples.
        self.used_blocks: list[int] = []
        self.waste_ratios: list[float] = []
        self.concurrency: list[int] = []
        self.contiguous_samples: list[int] = []
        self.contiguous_waste_ratios: list[float] = []

    # ---- bookkeeping -------------------------------------------------------------------
    def _reservation(self, line_no: int, seq_id: SeqId, num_tokens: int) -> tuple[int, int]:
        """(configured, exact) contiguous slots this sequence would reserve at admission;
        the configured baseline never reserves less than the sequence really needs."""
        length = self.lifetimes.get((line_no, seq_id), num_tokens)
        if self.max_model_len is not None:
            return max(length, self.max_model_len), length
        if self.max_output_len is not None:
            return max(length, num_tokens + self.max_output_len), length
        return length, length

    def _add_live(
        self, seq_id: SeqId, num_tokens: int, block_table: list[int], reserved: tuple[int, int]
    ) -> None:
        self.dead.discard(seq_id)
        self.live[seq_id] = _Live(num_tokens, block_table, *reserved)
        self.exact_slots += reserved[1]
        ref_cnt = self.ref_cnt
        for b in block_table:
            ref_cnt[b] = ref_cnt.get(b, 0) + 1
        self.live_tokens += num_tokens
        self.contiguous_slots += reserved[0]
        self.peak_contiguous_slots = max(self.peak_contiguous_slots, self.contiguous_slots)
        self.peak_concurrency = max(self.peak_concurrency, len(self.live))

    def _drop_live(self, seq_id: SeqId) -> None:
        seq = self.live.pop(seq_id)
        self.contiguous_slots -= seq.reserved_slots
        self.exact_slots -= seq.exact_slots
        self.live_tokens -= seq.num_tokens
        for b in seq.block_table:
            self._release(b)

    def _release(self, b: int) -> None:
        cnt = self.ref_cnt[b] - 1
        if cnt:
            self.ref_cnt[b] = cnt
        else:
            del self.ref_cnt[b]

    def _check_live(self, line_no: int, seq_id: SeqId) -> bool:
        """True if live, False if dead (caller skips); unknown ids are trace errors. A swapped-out
        sequence is swapped back in first (or, when it cannot come back now, dead: recomputed)."""
        if seq_id in self.live:
            return True
        if seq_id in self.swapped:
            return self._swap_in(seq_id)
        if seq_id in self.dead:
            self.skipped += 1
            return False
        raise TraceError(line_no, f"unknown sequence {seq_id!r} (never allocated, or already freed)")

    def _sample_usage(self) -> int:
        used = len(self.ref_cnt)
        self.peak_used_blocks = max(self.peak_used_blocks, used)
        return used

    def _waste_slots(self) -> int:
        """Empty slots of partial last blocks; a block shared by forks counts once."""
        bs = self.block_size
        partial = {seq.block_table[-1]: fill for seq in self.live.values() if (fill := seq.num_tokens % bs)}
        return bs * len(partial) - sum(partial.values())

    def _timed(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Call into the core, adding the time to `core_ns` (failed calls count too)."""
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            self.core_ns += time.perf_counter_ns() - start

    # ---- ops ---------------------------------------------------------------------------
    def apply(self, op: TraceOp) -> None:
        if isinstance(op, AllocateOp):
            self._allocate(op)
        elif isinstance(op, AppendOp):
            self._append(op)
        elif isinstance(op, ForkOp):
            self._fork(op)
        else:
            self._free(op)

    def _allocate(self, op: AllocateOp) -> None:
        if op.seq_id in self.live:
            raise TraceError(op.line_no, f"allocate: sequence {op.seq_id!r} is already live")
        try:
            result = self._timed(self.manager.allocate, op.seq_id, REPLAY_POOL, op.token_ids, salt=op.salt)
        except OutOfBlocks:
            self.rejected += 1
            self.dead.add(op.seq_id)
            return
        except CoreError as e:
            raise TraceError(op.line_no, f"allocate {op.seq_id!r}: {type(e).__name__}: {e}") from None
        num_tokens = len(op.token_ids)
        reserved = self._reservation(op.line_no, op.seq_id, num_tokens)
        self._add_live(op.seq_id, num_tokens, list(result.block_table), reserved)
        self._sample_usage()

    def _append(self, op: AppendOp) -> None:
        ids, toks = zip(*op.seqs) if op.seqs else ((), ())
        if self.live.keys() >= set(ids):    # the common step: every sequence live (checked in C)
            requests = list(map(AppendRequest, ids, map(len, toks), toks))
        else:
            requests = [
                AppendRequest(seq_id, len(token_ids), token_ids)
                for seq_id, token_ids in op.seqs
                if self._check_live(op.line_no, seq_id)
            ]
        if requests:
            start = time.perf_counter_ns()
            results = self.manager.append_slots(requests)
            pending = [i for i, r in enumerate(results) if isinstance(r, AppendFailure)
                       and isinstance(r.error, PendingWrite)]
            if pending:
                # Copy-on-write of a block this very step wrote (a fork of a fresh prompt): the
                # scheduler runs the prefill's Forward first, then appends the children.
                self._forward()
                retried = self.manager.append_slots([requests[i] for i in pending])
                for i, r in zip(pending, retried):
                    results[i] = r
            elapsed = time.perf_counter_ns() - start
            self.core_ns += elapsed
            self.append_step_ns.append(elapsed)
            self.append_batch_sizes.append(len(requests))
            for request, result in zip(requests, results):
                if isinstance(result, AppendFailure):
                    self._preempt_or_raise(op.line_no, request.seq_id, result.error)
                else:
                    self._apply_append(self.live[request.seq_id], result)
        self._forward()
        self._sample_step()

    def _apply_append(self, seq: _Live, result: AppendResult) -> None:
        self.live_tokens += result.num_tokens - seq.num_tokens
        seq.num_tokens = result.num_tokens
        table = seq.block_table
        for copy_op in result.copy_ops:  # copy-on-write replaces the shared last block
            self._release(table[-1])
            table[-1] = copy_op.dst
            self.ref_cnt[copy_op.dst] = self.ref_cnt.get(copy_op.dst, 0) + 1
        for b in result.new_block_ids:
            table.append(b)
            self.ref_cnt[b] = self.ref_cnt.get(b, 0) + 1

    def _forward(self) -> None:
        """The step's Forward, as a scheduler runs it: close the pool's step (its copies and
        deltas would go to the node) and report it complete."""
        start = time.perf_counter_ns()
        for out in self.manager.close_steps():
            self.manager.settle_steps(out.pool_id, out.step_id)
        self.core_ns += time.perf_counter_ns() - start

    def _preempt_or_raise(self, line_no: int, seq_id: SeqId, error: CoreError) -> None:
        if not isinstance(error, OutOfBlocks):
            raise TraceError(line_no, f"append {seq_id!r}: {type(error).__name__}: {error}")
        self._forward()  # the sequence's earlier writes ran before the scheduler preempts it
        if self.host_blocks and self.manager.can_swap_out([seq_id]):
            self._timed(self.manager.swap_out, [seq_id])
            self.swapped[seq_id] = self.live[seq_id]
            self._drop_live(seq_id)
            self.preempted += 1
            return
        self.recomputed_tokens += self.live[seq_id].num_tokens
        self._timed(self.manager.free, [seq_id])
        self._drop_live(seq_id)
        self.dead.add(seq_id)
        self.preempted += 1

    def _swap_in(self, seq_id: SeqId) -> bool:
        """Bring a swapped-out sequence back before its next append (its swap-out's step is
        reported first). When the device has no room yet it stays on host and this append is
        skipped (a scheduler would keep it waiting; the trace goes on without its tokens)."""
        self._forward()
        # like the engine: back only with a block to grow into, or it would thrash (in, out, in)
        if self.manager.free_blocks(REPLAY_POOL)[1] < len(self.swapped[seq_id].block_table) + 1:
            self.skipped += 1
            return False
        try:
            view = self._timed(self.manager.swap_in, [seq_id])[0]
        except OutOfBlocks:
            self.skipped += 1
            return False
        seq = self.swapped.pop(seq_id)
        self._add_live(seq_id, view.num_tokens, list(view.block_table), (seq.reserved_slots, seq.exact_slots))
        return True

    def _sample_step(self) -> None:
        used = self._sample_usage()
        self.used_blocks.append(used)
        allocated = used * self.block_size
        self.waste_ratios.append(self._waste_slots() / allocated if allocated else 0.0)
        self.concurrency.append(len(self.live))
        self.contiguous_samples.append(self.contiguous_slots)
        self.exact_samples.append(self.exact_slots)
        if self.contiguous_slots:
            self.contiguous_waste_ratios.append(1 - self.live_tokens / self.contiguous_slots)

    def _fork(self, op: ForkOp) -> None:
        for child_id in op.child_ids:
            if child_id in self.live:
                raise TraceError(op.line_no, f"fork: child {child_id!r} is already live")
        if not self._check_live(op.line_no, op.parent_id):
            self.dead.update(op.child_ids)
            return
        try:
            self._timed(self.manager.fork, op.parent_id, op.child_ids)
        except OutOfBlocks:
            self.rejected += len(op.child_ids)
            self.dead.update(op.child_ids)
            return
        except CoreError as e:
            raise TraceError(op.line_no, f"fork {op.parent_id!r}: {type(e).__name__}: {e}") from None
        parent = self.live[op.parent_id]
        for child_id in op.child_ids:
            reserved = self._reservation(op.line_no, child_id, parent.num_tokens)
            self._add_live(child_id, parent.num_tokens, list(parent.block_table), reserved)
        self._sample_usage()

    def _free(self, op: FreeOp) -> None:
        gone = [seq_id for seq_id in op.seq_ids if self.swapped.pop(seq_id, None) is not None]
        if gone:   # freed while swapped out: its host blocks go
            self._timed(self.manager.free, gone)
        seq_ids = [seq_id for seq_id in op.seq_ids if seq_id not in gone and self._check_live(op.line_no, seq_id)]
        for seq_id in op.seq_ids:
            self.dead.discard(seq_id)
        if seq_ids:
            try:
                self._timed(self.manager.free, seq_ids)
            except PendingWrite:
                # Freed in the step that wrote it: the scheduler runs that step's Forward first.
                self._forward()
                self._timed(self.manager.free, seq_ids)
            for seq_id in seq_ids:
                self._drop_live(seq_id)

    # ---- driver ------------------------------------------------------------------------
    def run(self, ops: list[TraceOp], *, fsck: bool = False) -> ReplayReport:
        start = time.perf_counter()
        self.lifetimes = _lifetime_lengths(ops)
        for op in ops:
            self.apply(op)
        wall_s = time.perf_counter() - start
        metrics = self.manager.metrics(REPLAY_POOL)
        step_us = sorted(ns / 1000 for ns in self.append_step_ns)
        num_steps = len(self.used_blocks)
        core_s = self.core_ns / 1e9
        paged_slots = sum(self.used_blocks) * self.block_size
        return ReplayReport(
            ops=len(ops),
            wall_s=wall_s,
            core_s=core_s,
            ops_per_s=len(ops) / core_s if core_s else 0.0,
            append_step_p50_us=percentile(step_us, 50) if step_us else 0.0,
            append_step_p99_us=percentile(step_us, 99) if step_us else 0.0,
            append_step_max_us=step_us[-1] if step_us else 0.0,
            num_append_steps=num_steps,
            mean_append_batch=_mean(self.append_batch_sizes),
            prefix_query_tokens=metrics.prefix_query_tokens,
            prefix_hit_tokens=metrics.prefix_hit_tokens,
            prefix_hit_rate=(
                metrics.prefix_hit_tokens / metrics.prefix_query_tokens if metrics.prefix_query_tokens else 0.0
            ),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            peak_used_blocks=self.peak_used_blocks,
            mean_used_blocks=_mean(self.used_blocks),
            cow_copies=metrics.cow_copies,
            evictions=metrics.evictions,
            rejected=self.rejected,
            preempted=self.preempted,
            skipped=self.skipped,
            waste_ratio=_mean(self.waste_ratios),
            peak_concurrency=self.peak_concurrency,
            mean_concurrency=_mean(self.concurrency),
            contiguous_baseline_blocks=math.ceil(self.peak_contiguous_slots / self.block_size),
            contiguous_mean_blocks=_mean(self.contiguous_samples) / self.block_size,
            concurrency_gain=sum(self.contiguous_samples) / paged_slots if paged_slots else 0.0,
            contiguous_waste_ratio=_mean(self.contiguous_waste_ratios),
            concurrency_gain_exact=sum(self.exact_samples) / paged_slots if paged_slots else 0.0,
            fsck_problems=self._fsck() if fsck else [],
            **self._host_counters(),
        )

    def _host_counters(self) -> dict[str, int]:
        host = self.manager.host_metrics(REPLAY_POOL)
        out = {"host_blocks": self.host_blocks, "preemptions": self.preempted,
               "recomputed_tokens": self.recomputed_tokens}
        if host is not None:
            out.update(host_hit_tokens=host.host_hit_tokens, swapped_out_blocks=host.swapped_out_blocks,
                       swapped_in_blocks=host.swapped_in_blocks, offloaded_blocks=host.offloaded_blocks,
                       onboarded_blocks=host.onboarded_blocks)
        return out

    def _fsck(self) -> list[str]:
        """The core's own check plus agreement between its state and the replay's view."""
        problems = list(self.manager.fsck())
        metrics = self.manager.metrics(REPLAY_POOL)
        if metrics.num_used_blocks != len(self.ref_cnt):
            problems.append(
                f"replay: core has {metrics.num_used_blocks} used blocks, results imply {len(self.ref_cnt)}"
            )
        if metrics.waste_slots != self._waste_slots():
            problems.append(f"replay: core waste {metrics.waste_slots} != replay waste {self._waste_slots()}")
        for view in self.manager.sequences(REPLAY_POOL):
            seq = self.live.get(view.seq_id)
            if seq is None or list(view.block_table) != seq.block_table or view.num_tokens != seq.num_tokens:
                problems.append(f"replay: table of {view.seq_id!r} differs from the results")
        if len(self.live) != metrics.num_sequences:
            problems.append(f"replay: {len(self.live)} live sequences, core has {metrics.num_sequences}")
        return problems


def _mean(values: list[int] | list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def replay(
    source: str | os.PathLike[str] | Iterable[str],
    *,
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool = True,
    watermark: float = 0.01,
    max_model_len: int | None = None,
    max_output_len: int | None = None,
    fsck: bool = False,
    host_blocks: int = 0,
) -> ReplayReport:
    """Replay a trace (a path, or an iterable of JSON lines) through a fresh core.

    Raises `TraceError` (with the line number) for malformed or inconsistent traces and
    `block_manager.core.errors.InvalidRequest` for a bad pool geometry or watermark.
    """
    ops = parse_trace(source)
    replayer = TraceReplayer(
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        watermark=watermark,
        max_model_len=max_model_len,
        max_output_len=max_output_len,
        host_blocks=host_blocks,
    )
    return replayer.run(ops, fsck=fsck)
