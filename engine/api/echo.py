"""`echo` on `/v1/completions`: the prompt returned before the completion, and with `logprobs`
the prompt tokens' log-probabilities in OpenAI's legacy shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), the first token's log-probability and top entry null.

This is what lm-eval's `local-completions` scores a model with (`echo=true, logprobs=1,
max_tokens=1`, or `max_tokens=0`: the prompt alone). The engine scores the prompt from the
prefill's own forward pass (`SamplingParams.prompt_logprobs`, `engine.prompt_scores`); a
prompt position's `top_logprobs` holds the prompt token and the `logprobs` most likely tokens,
as vLLM's server answers (so `logprobs` or `logprobs + 1` entries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.params import PromptLogprobs


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def prompt_logprobs_part(prompt_ids: list[int], scores: PromptLogprobs | None,
                         token_text: Callable[[int], str], num_top: int) -> dict[str, Any]:
    """The prompt's share of a choice's `logprobs`: per position the prompt token and its
    `num_top` most likely (the engine may have scored more for `prompt_logprobs`); text offsets
    start at 0 (the echoed text starts with the prompt). `scores` None (not scored: a refused
    request) leaves every log-probability null."""
    tokens: list[str] = []
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offset = 0
    for pos, tid in enumerate(prompt_ids):
        text = token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        entry = scores[pos] if scores is not None else None
        if entry is None or tid not in entry:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_finite(entry[tid].logprob))
        ranked = sorted(((t, lp) for t, lp in entry.items() if t == tid or (lp.rank or 0) <= num_top),
                        key=lambda kv: kv[1].rank or 0)
        tops.append(top_dict([(token_text(t), lp.logprob) for t, lp in ranked]))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def top_dict(ranked: list[tuple[str, float]]) -> dict[str, float]:
    """OpenAI's `{token text: logprob}` of tokens most likely first. Distinct tokens can share a
    text (pieces of one UTF-8 character all read "\ufffd"): the likeliest one's value stays."""
    out: dict[str, float] = {}
    for text, logprob in ranked:
        out.setdefault(text, _finite(logprob))
    return out


def vllm_prompt_logprobs(prompt_ids: list[int], scores: PromptLogprobs | None,
                         num_top: int) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` of a completion choice: None first, then per prompt token
    `{token id: {"logprob", "rank", "decoded_token"}}` with the prompt token and the `num_top`
    most likely."""
    if scores is None:
        return None
    out: list[dict[str, Any] | None] = []
    for tid, entry in zip(prompt_ids, scores):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in entry.items() if t == tid or (lp.rank or 0) <= num_top})
    return out


def merge_logprobs(prompt_part: dict[str, Any] | None, generated: dict[str, Any] | None) -> dict[str, Any] | None:
    """The prompt's entries, then the completion's (either may be absent)."""
    if prompt_part is None or generated is None:
        return prompt_part if generated is None else generated
    return {key: list(prompt_part[key]) + list(generated[key] or [None] * len(generated["tokens"]))
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


__all__ = ["merge_logprobs", "prompt_logprobs_part", "top_dict", "vllm_prompt_logprobs"]
