"""The engine's records of requests and of the sequences that generate their completions.

A request with `n` completions has `n` sequences. With `n > 1` and a prompt of two tokens or
more, one sequence prefills the prompt but its last token, then forks into the others
(copy-on-write shares every prompt block); each then computes the last prompt token itself
and samples its first token from its own seed. A preempted sequence is freed and later
re-admitted with everything it has (prompt and outputs) as its prompt: recomputed, it draws
the same tokens, since a seeded draw depends only on (seed, token index).

The lifecycle, in one place (`TRANSITIONS`; any other move raises `LifecycleError`):

    WAITING ──admit──> RUNNING ──finish──> FINISHED     (any state but FINISHED may finish)
    FORKING ──admit (its parent's fork)──> RUNNING
    FORKING ──detach (fork refused)──> WAITING
    RUNNING ──preempt──> PREEMPTED ──admit (recompute prompt + outputs)──> RUNNING
    RUNNING ──swap_out──> SWAPPED ──swap_in──> RUNNING     (host tier: docs/tiers.md)
    SWAPPED ──preempt (host full, swap lost)──> PREEMPTED

- WAITING: queued, never admitted; holds nothing (`seq_id` None).
- FORKING: a child of an `n > 1` request waiting for its parent's fork (which admits it onto
  the parent's blocks); `detach`: the fork was refused, it is admitted on its own.
- RUNNING: admitted; `seq_id` names its blocks on `node_id`.
- PREEMPTED: was running; its blocks are freed (or went with its node) and it is queued to
  recompute its prompt and outputs as a new prompt. `seq_id` is None: the id it had is the
  engine's to free (`preempt` hands it over), a re-admission gets a new one.
- SWAPPED: was running; its blocks are on its node's host tier (or on their way there, with
  the next Step), under the same `seq_id` on the same `node_id`; `swap_in` resumes it with
  everything computed (no recompute).
- FINISHED: stopped, aborted or done; nothing held once its free is sent.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from engine.node_api import SamplingSpec
from engine.params import CompletionOutput, PromptLogprobs, SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"       # never admitted: holds no block
    FORKING = "forking"       # a child waiting for its parent's fork
    RUNNING = "running"       # admitted: holds blocks on `node_id`
    PREEMPTED = "preempted"   # freed (or its node gone), queued to recompute everything it has
    SWAPPED = "swapped"       # its blocks on its node's host tier, queued to swap back in
    FINISHED = "finished"


TRANSITIONS: dict[SeqStatus, frozenset[SeqStatus]] = {
    SeqStatus.WAITING: frozenset({SeqStatus.RUNNING, SeqStatus.FINISHED}),
    SeqStatus.FORKING: frozenset({SeqStatus.RUNNING, SeqStatus.WAITING, SeqStatus.FINISHED}),
    SeqStatus.RUNNING: frozenset({SeqStatus.PREEMPTED, SeqStatus.SWAPPED, SeqStatus.FINISHED}),
    SeqStatus.SWAPPED: frozenset({SeqStatus.RUNNING, SeqStatus.PREEMPTED, SeqStatus.FINISHED}),
    SeqStatus.PREEMPTED: frozenset({SeqStatus.RUNNING, SeqStatus.FINISHED}),
    SeqStatus.FINISHED: frozenset(),
}
QUEUED = frozenset({SeqStatus.WAITING, SeqStatus.PREEMPTED})   # in the engine's waiting queue


class LifecycleError(RuntimeError):
    """A sequence was moved along a transition its lifecycle does not have, or asked for what
    its state does not hold (the admission of a queued sequence): an engine bug."""


@dataclass(slots=True, frozen=True)
class Admitted:
    """What a RUNNING or SWAPPED sequence holds: its admission's id at the block manager and
    the node (pool) its blocks are on. One value, so "admitted" is never half true."""

    seq_id: str
    node_id: str


@dataclass(slots=True, eq=False)   # identity: sequences and requests go in sets and lists
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.perf_counter)
    outputs: list[CompletionOutput] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    aborted: bool = False
    error: str | None = None       # why the engine could not serve it (its completions end with "error")
    unavailable: bool = False      # the error is this engine's state, not the request's: another may serve it
    detok_offsets: list[int] = field(default_factory=list)   # per completion: chars already emitted
    # SamplingParams.prompt_logprobs: per prompt position, None until scored (the first always
    # None); filled by position as chunks come back (engine.prompt_scores)
    prompt_logprobs: PromptLogprobs | None = None
    num_prompt_scored: int = 0     # positions 1 … of the prompt scored so far

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def scoring_prompt(self) -> bool:
        """Whether the prompt still has positions to score (its admissions bypass the prefix cache)."""
        return self.prompt_logprobs is not None and self.num_prompt_scored < len(self.prompt_token_ids) - 1


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion's generation stream on one node."""

    request: Request
    index: int                     # which completion
    token_ids: list[int]           # prompt (plus outputs) so far
    num_prompt: int                # tokens computed before the first sample of this admission
    seed: int | None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0          # tokens whose K/V the node holds (after the last Forward)
    fork_parent: bool = False      # n > 1: prefill the prompt but its last token, then fork
    last_token_s: float | None = None
    sampling_spec: SamplingSpec | None = None   # what its node samples with, built once (engine.pipeline)
    _held: Admitted | None = None  # the current admission: set exactly while RUNNING or SWAPPED
    _admissions: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def admitted(self) -> Admitted:
        """The current admission; `LifecycleError` unless RUNNING or SWAPPED (the scheduler
        asks only of those, so this is "running => admitted" in the types, no `or ""`)."""
        if self._held is None:
            raise LifecycleError(f"sequence {self.request.request_id}/{self.index} is {self.status.value}: "
                                 "it holds no admission")
        return self._held

    @property
    def seq_id(self) -> str | None:
        """The block manager's id for the current admission (None while it holds none)."""
        return self._held.seq_id if self._held is not None else None

    @property
    def node_id(self) -> str | None:
        """The node its blocks are on (None while it holds none)."""
        return self._held.node_id if self._held is not None else None

    def new_admission_id(self) -> str:
        return f"{self.request.request_id}/{self.index}/{next(self._admissions)}"

    # ---- the lifecycle's transitions (the only places that change `status`) ----------------
    def _move(self, to: SeqStatus) -> None:
        if to not in TRANSITIONS[self.status]:
            raise LifecycleError(f"sequence {self.request.request_id}/{self.index}: {self.status.value} -> {to.value}")
        self.status = to

    def admit(self, seq_id: str, node_id: str, num_computed: int) -> None:
        """Admitted (or forked onto its parent's blocks) as `seq_id` on `node_id`."""
        self._move(SeqStatus.RUNNING)
        self._held, self.num_computed = Admitted(seq_id, node_id), num_computed

    def preempt(self) -> str | None:
        """Out of its node: everything it has becomes its prompt, to recompute on re-admission.
        Returns the id it held (for the caller to free, or to forget when its node dropped it)."""
        self._move(SeqStatus.PREEMPTED)
        held, self._held = self.seq_id, None
        self.num_computed = 0
        self.num_prompt = len(self.token_ids)   # a fork parent keeps its flag until its fork ran
        return held

    def swap_out(self) -> None:
        """Preempted to the host tier: it keeps its id, node and computed tokens."""
        self._move(SeqStatus.SWAPPED)

    def swap_in(self) -> None:
        """Back on device (other blocks, same tokens): decoding continues where it stopped."""
        self._move(SeqStatus.RUNNING)

    def detach(self) -> None:
        """A fork child whose fork was refused: admitted on its own like a new sequence."""
        self._move(SeqStatus.WAITING)
        self._held = None

    def finish(self) -> str | None:
        """Done (stopped, length, aborted); returns the id it held, for the caller to free."""
        self._move(SeqStatus.FINISHED)
        held, self._held = self.seq_id, None
        return held

    @property
    def output(self) -> CompletionOutput:
        return self.request.outputs[self.index]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output.token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the sequence samples (or forks)."""
        return self.num_prompt - 1 if self.fork_parent else self.num_prompt


__all__ = ["QUEUED", "TRANSITIONS", "Admitted", "LifecycleError", "Request", "SeqStatus", "Sequence"]
