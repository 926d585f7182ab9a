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
MAX_CACHE_SALT_CHARS = 1024   # what the block manager accepts in a Step


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

    `prompt_logprobs` (vLLM's name and shape): None scores no prompt token; N returns
    `RequestOutput.prompt_logprobs`, a list with one entry per prompt token: None for the first
    (nothing predicts it), then a dict `{token_id: Logprob}` holding the actual prompt token and
    the N most likely tokens at that position (N or N+1 entries; 0: only the actual token). They
    are log-softmax values of the model's raw logits, from the same forward pass as the
    prefill. A request that asks for them does not read the prefix cache (as in vLLM): every
    prompt position is computed, since a cached block holds K/V, not the logits that scored it;
    `num_cached_tokens` is then 0. Its blocks are not registered in the cache either (the block
    manager is asked for them by count). With `n > 1` the prompt is scored once.

    `cache_salt` (vLLM's name): requests share prefix-cached KV blocks only with requests of
    the same salt (None: the unsalted cache). A salt is a non-empty string of at most 1024
    characters; an empty string is refused (as vLLM does), not taken as None.
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
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

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
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidParams(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                                f"got {self.prompt_logprobs!r}")
        _check_cache_salt(self.cache_salt)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _check_cache_salt(salt: object) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidParams(f"cache_salt must be None or a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                            f"characters, got {salt!r:.80}")


@dataclass(slots=True, frozen=True)
class Logprob:
    """One token's log-probability at a prompt position (vLLM's `Logprob`): `rank` 1 is the
    most likely token; `decoded_token` its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]


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
    # with SamplingParams.prompt_logprobs: None until the whole prompt is scored, then per
    # prompt token None (the first) or {token_id: Logprob}
    prompt_logprobs: PromptLogprobs | None = None
    unavailable: bool = False           # the error is this engine's state, not the request's (retry elsewhere)


__all__ = ["MAX_CACHE_SALT_CHARS", "MAX_N", "CompletionOutput", "InvalidParams", "Logprob", "PromptLogprobs",
           "RequestOutput", "SamplingParams"]
