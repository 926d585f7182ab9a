"""What a user asks for (`SamplingParams`) and gets back (`RequestOutput`), in the shape vLLM and
nano-vllm users already know: `llm.generate(prompts, SamplingParams(n=2, temperature=0.8))`
returns one `RequestOutput` per prompt whose `.outputs[j]` holds one completion's token ids
and text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_N = 64
MAX_LOGPROBS = 20


class InvalidParams(ValueError):
    """A sampling parameter out of range (the API server answers 400 with the message)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to generate for one prompt.

    `temperature` 0 is greedy. `top_k` 0 or None and `top_p` 1 disable their filters. `seed`
    makes a request reproducible (also across embedded and services mode, and across
    preemption: token i is drawn from a number derived from (seed, i)); the `n` completions
    of a seeded request get independent streams derived from it. Generation stops at
    `max_tokens`, at the model's EOS token (unless `ignore_eos`), or at any of
    `stop_token_ids`. `logprobs`: None returns none, 0 the sampled token's, k also the k most
    likely tokens'.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidParams(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidParams(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise InvalidParams(f"top_k must be None or an integer >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p < 1:
            raise InvalidParams(f"min_p must be in [0, 1), got {self.min_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParams(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise InvalidParams(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParams(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stops = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise InvalidParams(f"stop_token_ids must be non-negative integers, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidParams(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's `n` completions, as far as it got."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None                        # per token, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when logprobs > 0
    # "stop" (EOS / stop token), "length" (max_tokens / context), "abort", "error" (see RequestOutput.error)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step (streaming) or at its end (`LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    finished: bool = False
    error: str | None = None            # why the engine could not serve it (finish reason "error")


__all__ = ["CompletionOutput", "InvalidParams", "MAX_N", "RequestOutput", "SamplingParams"]
