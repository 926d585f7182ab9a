"""The engine's records of requests and of the sequences that generate their completions.

A request with `n` completions has `n` sequences. With `n > 1` and a prompt of two tokens or
more, one sequence prefills the prompt but its last token, then forks into the others
(copy-on-write shares every prompt block); each then computes the last prompt token itself
and samples its first token from its own seed. A preempted sequence is freed and later
re-admitted with everything it has (prompt and outputs) as its prompt: recomputed, it draws
the same tokens, since a seeded draw depends only on (seed, token index).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from engine.params import CompletionOutput, SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"     # not admitted (or preempted): holds no block
    RUNNING = "running"     # admitted: holds blocks on `node_id`
    FORKING = "forking"     # a child created by a fork this step (holds the parent's blocks)
    FINISHED = "finished"


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
    detok_offsets: list[int] = field(default_factory=list)   # per completion: chars already emitted

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion's generation stream on one node."""

    request: Request
    index: int                     # which completion
    token_ids: list[int]           # prompt (plus outputs) so far
    num_prompt: int                # tokens computed before the first sample of this admission
    seed: int | None
    seq_id: str = ""               # the block manager's id for the current admission
    node_id: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0          # tokens whose K/V the node holds (after the last Forward)
    fork_parent: bool = False      # n > 1: prefill the prompt but its last token, then fork
    last_token_s: float | None = None
    _admissions: itertools.count = field(default_factory=itertools.count)

    def new_admission_id(self) -> str:
        return f"{self.request.request_id}/{self.index}/{next(self._admissions)}"

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


__all__ = ["Request", "SeqStatus", "Sequence"]
