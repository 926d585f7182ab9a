"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): which rows of a step a node
scores, and where the scores go.

The node scores prompt tokens from the very forward pass that prefills them: in a step that
computes positions `[start, end)` of a sequence, the row at position i predicts token i + 1,
so the step asks for the targets `prompt[start + 1 : min(end, P - 1) + 1]` (P: the prompt's
length). With chunked prefill a prompt is scored over several steps and the scores are stored
by position, so a chunk computed twice (a failed step, a preemption before the prompt was
scored) overwrites, never duplicates. Only completion 0 of a request scores (the others share
its prompt). No step asks for anything once the prompt is scored, so decode steps and
requests without `prompt_logprobs` cost nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.node_api import PromptLogprobsSpec, PromptScores
from engine.params import Logprob
from engine.sequence import Request, Sequence

Detokenize = Callable[[list[int]], str]   # token ids -> text


def start_scoring(request: Request) -> None:
    """Give a request that asks for prompt log-probabilities its per-position record."""
    if request.params.prompt_logprobs is not None:
        request.prompt_logprobs = [None] * len(request.prompt_token_ids)


def scoring_spec(seq: Sequence, start: int, end: int) -> PromptLogprobsSpec | None:
    """What a step computing positions `[start, end)` of `seq` asks its node to score (None:
    nothing: another completion, a prompt already scored, or positions past the prompt)."""
    req = seq.request
    num_top = req.params.prompt_logprobs
    if num_top is None or seq.index != 0 or not req.scoring_prompt:
        return None
    last = min(end, len(req.prompt_token_ids) - 1)   # the last position whose row predicts a prompt token
    if last <= start:
        return None
    return PromptLogprobsSpec(num_top, tuple(req.prompt_token_ids[start + 1 : last + 1]))


def store_scores(req: Request, start: int, scores: PromptScores, spec: PromptLogprobsSpec,
                 detokenize: Detokenize | None) -> None:
    """Store a node's scores of a step that started at position `start` (the row at position
    i scores prompt token i + 1): per position, the actual token and the top tokens."""
    record = req.prompt_logprobs
    if record is None:
        return
    for i, target in enumerate(spec.target_token_ids):
        entry = {tid: Logprob(lp, rank + 1, _text(detokenize, tid)) for rank, (tid, lp) in enumerate(scores.top[i])}
        entry[target] = Logprob(scores.logprobs[i], scores.ranks[i], _text(detokenize, target))
        position = start + 1 + i
        if record[position] is None:
            req.num_prompt_scored += 1
        record[position] = entry


def answer_matches(spec: PromptLogprobsSpec, scores: PromptScores | None) -> bool:
    """Whether a node's answer holds one score per target (and one top list per target)."""
    n = len(spec.target_token_ids)
    return scores is not None and len(scores.logprobs) == len(scores.ranks) == len(scores.top) == n


def _text(detokenize: Callable[[list[int]], str] | None, token_id: int) -> str | None:
    return None if detokenize is None else detokenize([token_id])


__all__ = ["Detokenize", "answer_matches", "scoring_spec", "start_scoring", "store_scores"]
