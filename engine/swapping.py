"""Swap preemption (the host tier, docs/tiers.md): the engine's side.

A running sequence that must give up its blocks for another's append goes to its node's host
tier when it has one (`preemption_mode`): its swap-out rides with the next Step, and it comes
back (oldest first, before new admissions) once its swap-out's step ran and its node has the
blocks. What a refused swap, or a swapped sequence that cannot come back, does is the failure
table's (`engine.failure_policy`: SWAP_OUT, SWAP_IN, HELD rows), carried out by the `refuse` the
scheduler passes in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from block_manager.client import ItemFailure, PoolGoneError, StepResult, SyncStep
from block_manager.core.types import SeqId
from engine.config import EngineConfig
from engine.errors import EpochDropped, NodeOutOfPlacement
from engine.failure_policy import Action, Item
from engine.queues import SeqQueues
from engine.sequence import SeqStatus, Sequence
from engine.stats import EngineStats
from engine.step_plan import NodeView, StepPlan
from pagedkv.tiers import TierKind  # the tier moves a PoolStep gives each copy: counted for the stats only

Refuse = Callable[[Item, BaseException, Sequence], Action]   # the scheduler's failure executor


@dataclass(slots=True)
class SwapPolicy:
    """Which preemption victims swap, which swapped sequences come back this Step, and what the
    Step's answer says of them."""

    config: EngineConfig
    queues: SeqQueues
    view: NodeView
    stats: EngineStats
    to_swap_out: list[Sequence] = field(default_factory=list)      # victims whose swap-out goes with the next Step
    swap_step: dict[Sequence, int] = field(default_factory=dict)   # the step whose Step sent a sequence's swap-out

    def swaps_to(self, node_id: str) -> bool:
        mode = self.config.preemption_mode
        return mode == "swap" or (mode == "auto" and node_id in self.view.host_pools)

    def preempt_victim(self, seq: Sequence) -> None:
        """Preempt running `seq` for a starved append: to its node's host tier (its swap-out goes
        with the next Step), or by recompute."""
        if not self.swaps_to(seq.admitted.node_id):
            self.queues.preempt(seq, free=True)
            return
        self.queues.running.remove(seq)
        seq.swap_out()
        self.queues.swapped.append(seq)
        self.to_swap_out.append(seq)

    def recompute(self, seq: Sequence, *, free: bool) -> None:
        """A swapped sequence that cannot come back from host: recompute it (the fallback). One
        whose swap-out is not sent yet never leaves its device blocks (`free` frees those)."""
        self.queues.swapped.remove(seq)
        self.swap_step.pop(seq, None)
        if seq in self.to_swap_out:
            self.to_swap_out.remove(seq)
        self.stats.recompute_fallbacks += 1
        self.stats.recomputed_tokens += seq.num_computed
        self.queues.requeue(seq, free=free)

    def forget(self, seq: Sequence) -> None:
        """A swapped sequence that finished (an abort): nothing of it is swapped any more."""
        self.swap_step.pop(seq, None)
        if seq in self.to_swap_out:
            self.to_swap_out.remove(seq)

    def plan(self, batch: SyncStep, plan: StepPlan, refuse: Refuse) -> None:
        """This Step's swap-outs (last step's victims) and swap-ins: the oldest swapped-out
        sequences whose swap-out step ran, while their node has the blocks to spare. One whose
        pool is gone or whose node is out of placement cannot come back from that host tier:
        the failure table says what then (HELD)."""
        out, self.to_swap_out = self.to_swap_out, []
        if out:
            batch.swap_out([s.admitted.seq_id for s in out])
            for s in out:
                self.swap_step[s] = self.stats.num_steps
        usable = {pid: u for pid, (_f, u) in self.view.pool_free.items()}
        out_ids = {o.admitted.seq_id for o in out}
        for seq in [s for s in self.queues.swapped if s.admitted.seq_id not in out_ids]:
            node_id = seq.admitted.node_id
            if usable and node_id not in usable:
                refuse(Item.HELD, PoolGoneError(f"pool {node_id!r} is gone"), seq)
            elif node_id in self.view.down:
                refuse(Item.HELD, NodeOutOfPlacement(node_id), seq)
        back: list[Sequence] = []
        for seq in self.queues.swapped:
            if self.swap_step.get(seq, self.stats.num_steps) >= self.stats.num_steps:
                break   # swapped out by this very Step (or not sent yet): its host copy is not written
            node_id = seq.admitted.node_id
            need = -(-seq.num_computed // self.view.block_size(node_id)) + 1   # its blocks, and one to grow into
            if usable.get(node_id, 0) < need + len(back):
                break   # oldest first: a later one does not overtake it
            usable[node_id] = usable.get(node_id, 0) - need
            back.append(seq)
        if back:
            batch.swap_in([s.admitted.seq_id for s in back])
        plan.swapping_out, plan.swapping_in = out, back

    def apply(self, result: StepResult, plan: StepPlan, refuse: Refuse) -> None:
        """The Step's answer for swaps: a swap-out done counts; a swap-in done resumes the
        sequence (its next token next step); a refused one, and a swapped sequence the block
        manager dropped (the step that carried its swap-out failed), go by the failure table."""
        for seq in plan.swapping_out:
            if seq.status is not SeqStatus.SWAPPED:
                continue
            failure = result.swapped_out.get(SeqId(seq.admitted.seq_id))
            if isinstance(failure, ItemFailure):
                refuse(Item.SWAP_OUT, failure.error, seq)
            else:
                self.stats.num_swap_outs += 1
        for seq in plan.swapping_in:
            answer = result.swapped_in.get(SeqId(seq.admitted.seq_id))
            if isinstance(answer, int):
                self.queues.swapped.remove(seq)
                self.swap_step.pop(seq, None)
                seq.swap_in()
                self.queues.running.append(seq)
                self.stats.num_swap_ins += 1
            elif isinstance(answer, ItemFailure):
                refuse(Item.SWAP_IN, answer.error, seq)
        for seq in [s for s in self.queues.swapped if s.seq_id in result.dropped]:
            refuse(Item.HELD, EpochDropped(seq.admitted.seq_id), seq)
        self._count_moves(result)

    def _count_moves(self, result: StepResult) -> None:
        """The stats of the tier moves and prefix fetches this Step gave the nodes."""
        for info in result.steps.values():
            for f in info.message.fetches:   # prefix fetch: pulled by the node instead of recomputed
                self.stats.fetched_tokens += len(f.token_ids)
            kinds = list(info.message.tier_kind)
            if kinds:
                bs = self.view.block_size(info.pool_id)
                self.stats.swapped_out_blocks += kinds.count(TierKind.SWAP_OUT)
                self.stats.swapped_in_blocks += kinds.count(TierKind.SWAP_IN)
                self.stats.offloaded_blocks += kinds.count(TierKind.OFFLOAD)
                self.stats.onboarded_blocks += kinds.count(TierKind.ONBOARD)
                from_disk = kinds.count(TierKind.DISK_ONBOARD)   # each also onboarded host->device (TierKind.ONBOARD)
                self.stats.host_hit_tokens += (kinds.count(TierKind.ONBOARD) - from_disk) * bs
                self.stats.disk_offloaded_blocks += kinds.count(TierKind.DISK_OFFLOAD)
                self.stats.disk_onboarded_blocks += from_disk
                self.stats.disk_hit_tokens += from_disk * bs


__all__ = ["SwapPolicy"]
