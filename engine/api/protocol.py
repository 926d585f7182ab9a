"""The OpenAI wire format of the API server: request bodies, their translation into prompts and
`SamplingParams`, and the error shape.

Requests are pydantic models that accept unknown fields (clients send `user`, `metadata`,
`store`, ... which change nothing here) and check the rest by hand, so every refusal names the
parameter it is about, as OpenAI's `{"error": {"message", "type", "param", "code"}}` does.
Extensions beyond OpenAI's parameters, as vLLM accepts them: `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`, `cache_salt`, `add_special_tokens`, `stream_options.
continuous_usage_stats` (both endpoints), `add_generation_prompt` (chat).
`echo` (completions) returns the prompt before the completion and, with `logprobs`, the
prompt tokens' log-probabilities (the first token's null), as OpenAI's legacy API and vLLM do;
`max_tokens=0` is allowed with `echo` only and returns just the prompt (vLLM's behaviour).
`prompt_logprobs` (completions, vLLM's extension, not with `stream`) adds each choice's
`prompt_logprobs` in vLLM's shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from engine.params import MAX_LOGPROBS, MAX_N, InvalidParams, SamplingParams

MAX_PROMPTS = 1024            # prompts in one /v1/completions request
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


class APIError(Exception):
    """An error answered as OpenAI does: HTTP `status` and the error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    repetition_penalty: float | None = None
    cache_salt: str | None = None          # isolates the prefix cache per tenant (engine.params)
    # encode text with the tokenizer's special tokens (BOS): None is the endpoint's default,
    # True for completions, False for chat (its template writes them)
    add_special_tokens: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """`stream_options.continuous_usage_stats` (vLLM's): every chunk carries the usage so far,
        not only the last one (load generators read it as they go)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))


class CompletionRequest(_Request):
    prompt: Any = None
    max_tokens: int | None = None          # OpenAI's default for completions is 16
    logprobs: int | None = None
    echo: bool | None = False
    prompt_logprobs: int | None = None     # vLLM's extension: the choice's `prompt_logprobs` (not streamed)
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Request):
    messages: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True


@dataclass(slots=True)
class Prompt:
    """One prompt to generate for: its text when it came as text, and its token ids."""

    text: str | None
    token_ids: list[int]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_unsupported(req: _Request) -> None:
    """Refuse parameters that would change the result but are not implemented (silently ignoring
    them would return something else than what was asked for)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported (only 0)", name)
    if req.repetition_penalty not in (None, 1, 1.0):
        raise bad_request("repetition_penalty is not supported (only 1)", "repetition_penalty")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of other than n is not supported", "best_of")
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs are not available with stream=true (as in vLLM)", "prompt_logprobs")
    if isinstance(req, ChatCompletionRequest):
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported", "tool_choice")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", "response_format")


def stop_strings(req: _Request) -> tuple[str, ...]:
    stop = req.stop
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise bad_request(f"stop strings must be 1 to {MAX_STOP_LEN} characters long", "stop")
    return tuple(items)


def completion_prompts(prompt: Any, encode: Any, vocab_size: int) -> list[Prompt]:
    """`prompt` as OpenAI allows it: a string, a list of strings, a list of token ids, or a list
    of lists of token ids."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of such "
                          "lists, and not empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    out: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            out.append(Prompt(item, list(encode(item))))
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            if min(item) < 0 or max(item) >= vocab_size:
                raise bad_request(f"prompt token ids must be in [0, {vocab_size})", "prompt")
            out.append(Prompt(None, list(item)))
        else:
            raise bad_request("each prompt must be a string or a non-empty list of token ids", "prompt")
    return out


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation with every message's content as one string (text parts joined);
    anything but text is refused."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] needs a string role", "messages")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({**{k: v for k, v in m.items() if k not in ("role", "content")}, "role": role, "content": text})
    return out


def _finite(value: float | None, name: str) -> None:
    if value is not None and not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number", name)


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, *, logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's parameters; OpenAI's ranges on top of the engine's own checks.
    `prompt_logprobs`: score the prompt too (completions with `echo` and `logprobs`)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    for name in ("temperature", "top_p", "min_p"):
        _finite(getattr(req, name), name)
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    top_k = req.top_k
    if top_k is not None and top_k in (-1, 0):
        top_k = None                                  # vLLM's "off"
    try:
        return SamplingParams(
            n=n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            max_tokens=max_tokens,
            seed=req.seed,
            ignore_eos=bool(req.ignore_eos),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=req.cache_salt,
        )
    except InvalidParams as exc:
        message = str(exc)
        raise bad_request(message, message.split(" ", 1)[0]) from None


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, str]:
    """The explicit output limit and the parameter it came from (None: not given); 0 only for
    a completion with `echo` (the prompt alone, as vLLM answers it)."""
    value: int | None
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        value, name = req.max_completion_tokens, "max_completion_tokens"
    else:
        value, name = req.max_tokens, "max_tokens"
    echo_only = isinstance(req, CompletionRequest) and bool(req.echo) and value == 0
    if value is not None and value < 1 and not echo_only:
        raise bad_request(f"{name} must be at least 1 (0 only with echo), got {value}", name)
    return value, name


def resolve_max_tokens(
    prompts: Sequence[Prompt], requested: int | None, param: str, default: int | None,
    *, prompt_param: str, max_model_len: int, kv_capacity: int,
) -> int:
    """The output limit every prompt can honour, or a 400 naming the limit a prompt breaks.

    A prompt must leave room for one generated token within the model's context and within the
    largest KV pool (a sequence never spans pools); an explicit limit must fit whole (as OpenAI
    and vLLM answer); a default limit is cut to what fits."""
    limit = min(max_model_len, kv_capacity)
    longest = max(len(p.token_ids) for p in prompts)
    if longest >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{longest} tokens (the prompt and at least one generated token must fit).",
            prompt_param, "context_length_exceeded",
        )
    if longest + 1 > kv_capacity:
        raise bad_request(
            f"The prompt has {longest} tokens, but the KV cache can hold at most {kv_capacity} tokens of one "
            "sequence (prompt and at least one generated token).", prompt_param, "context_length_exceeded",
        )
    if requested is not None:
        if longest + requested > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{longest + requested} tokens ({longest} in the prompt, {requested} in the completion).",
                param, "context_length_exceeded",
            )
        if longest + requested > kv_capacity:
            raise bad_request(
                f"The KV cache can hold at most {kv_capacity} tokens of one sequence. However, you requested "
                f"{longest + requested} tokens ({longest} in the prompt, {requested} in the completion).",
                param, "context_length_exceeded",
            )
        return requested
    room = limit - longest
    return room if default is None else min(default, room)


def prompt_logprobs_count(req: CompletionRequest, logprobs: int | None) -> int | None:
    """How many top tokens the engine scores per prompt position (None: it scores none):
    `logprobs` for `echo`, vLLM's `prompt_logprobs`, the larger when both are asked."""
    asked = req.prompt_logprobs
    if asked is not None and not 0 <= asked <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {asked}", "prompt_logprobs")
    counts = [c for c in (logprobs if req.echo else None, asked) if c is not None]
    return max(counts) if counts else None


def logprobs_count(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The engine's `logprobs`: None (none), 0 (the sampled token's) or k (and the top k)."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is None:
            return None
        if not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
        return req.logprobs
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


__all__ = [
    "APIError", "ChatCompletionRequest", "CompletionRequest", "Prompt", "bad_request", "chat_messages",
    "check_unsupported", "completion_prompts", "logprobs_count", "prompt_logprobs_count", "requested_max_tokens",
    "resolve_max_tokens",
    "sampling_params", "stop_strings",
]
