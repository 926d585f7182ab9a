"""Swap preemption (the host tier, docs/tiers.md): the engine's side.

A running sequence that must give up its blocks for another's append goes to its node's host
tier when it has one (`preemption_mode`): its swap-out rides with the next Step, and it comes
back (oldest first, before new admissions) once its swap-out's step ran and its node has the
blocks. A swap that cannot happen falls back to recompute. Mixed into `LLMEngine`.
"""

from __future__ import annotations

from typing import Any

from block_manager.client import ItemFailure, StepResult
from engine.sequence import SeqStatus, Sequence
from pagedkv.logging import get_logger

log = get_logger("engine.swapping")


class SwapPreemption:
    """The engine's swap-out / swap-in planning and the Step answer's swap items."""

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


__all__ = ["SwapPreemption"]
