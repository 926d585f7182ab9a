"""Sampling on the node: logits in, token ids (and logprobs) out; logits never leave.

Reproducibility. A seeded sequence's k-th sampled token is a function of (seed, k, its logits)
and nothing else — not of the batch it ran in, the node, or what was sampled before — so a
sequence recomputed after preemption, or run embedded instead of through the services, draws
the same tokens. That rules out a shared generator whose state advances with every draw. Each
row instead gets one uniform number from a counter-based hash, `uniform(seed, k)`, and picks
its token by inverse CDF over the processed distribution (in vocabulary order, float64 sums):
one scalar per row, computed on the host, so the draw is also identical on every device.
Unseeded rows take their uniform from one process-wide RNG.

Processing order (the order transformers applies its warpers): temperature → top-k → top-p →
min-p. Greedy (temperature 0) rows skip all of it and take the argmax, in one vectorised call.

Logprobs are those of the model's raw distribution (log-softmax of the unprocessed logits),
which is what OpenAI-style APIs report, not of the filtered sampling distribution.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compute_node.model.errors import InvalidSamplingParams
from kernels.cpu.argmax import argmax_rows
from pagedkv import seeds
from pagedkv.seeds import MASK64, mix64

if TYPE_CHECKING:   # batch.py imports this module
    from compute_node.model.batch import PromptLogprobs

MAX_LOGPROBS = 20
# Temperatures below this are greedy: dividing logits by them would overflow float32.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one sequence picks its next token.

    `temperature` 0 (or below 1e-5) is greedy. `top_k` None (or ≥ vocab) and `top_p` 1 and `min_p` 0 disable
    their filter. `seed` None samples from the process RNG (not reproducible). `logprobs` None
    returns no logprobs; 0 the sampled token's; k also the k most likely tokens'.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise InvalidSamplingParams(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise InvalidSamplingParams(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1):
            raise InvalidSamplingParams(f"min_p must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidSamplingParams(f"seed must be None or an integer, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidSamplingParams(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None                       # raw logprob of `token_id`, when asked
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), most likely first


def derive_seed(seed: int, child_index: int) -> int:
    """The seed of parallel sample `child_index` (n > 1) of a request seeded with `seed`
    (`pagedkv.seeds.derive_seed`, where the engine takes it from without torch)."""
    if child_index < 0:
        raise InvalidSamplingParams(f"child_index must be >= 0, got {child_index}")
    return seeds.derive_seed(seed, child_index)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) that drives token `index` of a sequence seeded `seed`."""
    return (mix64(seed & MASK64, index) >> 11) * 2.0**-53


class Sampler:
    """Turns a batch's float32 logits `[num_rows, vocab]` into one token per row."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> list[SampledToken]:
        """Row i is sampled with `params[i]` as token number `output_indices[i]` of its sequence."""
        num_rows = logits.shape[0]
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == num_rows:
            token_ids = greedy_tokens(logits)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
            if greedy_rows:
                rows = torch.tensor(greedy_rows, device=logits.device)
                token_ids[rows] = greedy_tokens(logits[rows])
            random_rows = [i for i, p in enumerate(params) if not p.greedy]
            rows = torch.tensor(random_rows, device=logits.device)
            uniforms = [
                seeded_uniform(seed, output_indices[i]) if (seed := params[i].seed) is not None else self.rng.random()
                for i in random_rows
            ]
            token_ids[rows] = self._draw(logits[rows], [params[i] for i in random_rows], uniforms)
        results = [SampledToken(t) for t in token_ids.tolist()]
        self._add_logprobs(logits, params, token_ids, results)
        return results

    def probabilities(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each non-greedy row samples from: float32 `[num_rows, vocab]` after
        temperature, top-k, top-p and min-p (zero outside the kept support)."""
        return self._filtered_logits(logits, params).softmax(dim=-1)

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
        probs = self.probabilities(logits, params)
        cdf = probs.to(torch.float64).cumsum(dim=-1)                    # [rows, vocab]
        u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device)
        targets = (u * cdf[:, -1]).unsqueeze(-1)
        # The first token whose cumulative mass exceeds the target: a token of zero
        # probability adds nothing to the sum, so it can never be that token.
        token_ids = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
        overflow = token_ids >= logits.shape[-1]   # u * total rounded up to total (p ~ 1e-16)
        if bool(overflow.any()):
            token_ids = torch.where(overflow, probs.argmax(dim=-1), token_ids)
        return token_ids

    def _filtered_logits(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        device = logits.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
        x = logits.to(torch.float32) / temps.unsqueeze(-1)
        top_ks = [min(p.top_k, vocab) if p.top_k is not None else vocab for p in params]
        if min(top_ks) < vocab:
            # Keep every token scoring at least the k-th best (ties at the boundary all stay).
            kth = torch.topk(x, max(top_ks), dim=-1).values
            ks = torch.tensor(top_ks, device=device).unsqueeze(-1) - 1
            x = x.masked_fill(x < kth.gather(-1, ks.clamp_max(kth.shape[-1] - 1)), -math.inf)
        top_ps = [p.top_p for p in params]
        if min(top_ps) < 1.0:
            # Keep the smallest most-likely set whose mass reaches top_p: drop the ascending
            # prefix whose cumulative mass stays within 1 - top_p (the most likely token stays).
            sorted_x, order = x.sort(dim=-1)
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - torch.tensor(top_ps, device=device)).unsqueeze(-1)
            drop[:, -1] = False
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, -math.inf))
        min_ps = [p.min_p for p in params]
        if max(min_ps) > 0.0:
            probs = x.softmax(dim=-1)
            floor = torch.tensor(min_ps, device=device).unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
            x = x.masked_fill(probs < floor, -math.inf)
        return x

    @staticmethod
    def _add_logprobs(
        logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor, results: list[SampledToken]
    ) -> None:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return
        rows = torch.tensor(wanted, device=logits.device)
        logprobs = logits[rows].to(torch.float32).log_softmax(dim=-1)
        chosen = logprobs.gather(-1, token_ids[rows].unsqueeze(-1)).squeeze(-1).tolist()
        num_top = max(params[i].logprobs or 0 for i in wanted)
        top_values = top_ids = None
        if num_top:
            top = torch.topk(logprobs, num_top, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for j, i in enumerate(wanted):
            results[i].logprob = chosen[j]
            k = params[i].logprobs or 0
            if k and top_values is not None and top_ids is not None:
                results[i].top_logprobs = list(zip(top_ids[j][:k], top_values[j][:k]))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 `[rows]`, each row's argmax (the first of tied maxima): float32 CPU logits through
    the vectorised kernel (`kernels.cpu.argmax`: ~10x torch's CPU argmax on a decode step's
    rows), anything else through torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.is_contiguous() and logits.shape[1]:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def score_rows(logits: torch.Tensor, targets: torch.Tensor, num_top: int, out: PromptLogprobs) -> None:
    """Append each row's scores of its target token to `out`: raw log-probability (float32
    log-softmax, as the sampled tokens' logprobs), rank (1 + the tokens scoring strictly higher:
    ties share the better rank) and the `num_top` most likely tokens."""
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    chosen = logprobs.gather(-1, targets.unsqueeze(-1))                # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    out.logprobs.extend(chosen.squeeze(-1).tolist())
    out.ranks.extend(int(r) for r in ranks.tolist())
    if not num_top:
        out.top.extend([] for _ in range(logits.shape[0]))
        return
    top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
    out.top.extend(list(zip(ids, values)) for ids, values in zip(top.indices.tolist(), top.values.tolist()))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
