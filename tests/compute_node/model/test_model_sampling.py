"""Node-side sampling: parameter checks, greedy, the reproducibility rule (a seeded draw depends
only on seed, output index and logits), and the filtered distributions against an independent
NumPy implementation, both exactly (support, probabilities) and statistically (frequencies)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from compute_node.model import InvalidSamplingParams, SamplingParams, derive_seed, seeded_uniform
from compute_node.model.sampling import Sampler

LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.3, -0.2, -0.5, -1.1, -2.0])   # distinct: no ties


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
        {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": 2.5}, {"min_p": 1.0}, {"min_p": -0.1},
        {"seed": 1.5}, {"seed": "7"}, {"logprobs": -1}, {"logprobs": 21}, {"logprobs": True},
    ],
)
def test_invalid_params_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kwargs)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(temperature=1e-9),
              SamplingParams(), SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=2, top_k=3)]
    out = Sampler().sample(logits, params, [0] * 6)
    for i in (0, 2, 4):
        assert out[i].token_id == int(logits[i].argmax())
    assert out[4].top_logprobs is not None and out[4].top_logprobs[0][0] == out[4].token_id


def test_seeded_draw_depends_only_on_seed_index_and_logits() -> None:
    row = torch.randn(200, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = [Sampler().sample(row[None], [params], [k])[0].token_id for k in range(40)]
    # Other batch compositions, positions, a sampler whose RNG has been used, other rows seeded
    # and unseeded around it: the same 40 tokens.
    busy = Sampler(random.Random(99))
    for k in range(40):
        others = torch.randn(3, 200)
        busy.sample(others, [SamplingParams()] * 3, [k, k, k])
        batch = torch.stack([others[0], others[1], row, others[2]])
        mixed = [SamplingParams(seed=k), SamplingParams(), params, SamplingParams(temperature=0.0)]
        assert busy.sample(batch, mixed, [3, 0, k, 5])[2].token_id == alone[k]
    assert len(set(alone)) > 5, "the output index must change the draw"
    other_seed = [Sampler().sample(row[None], [SamplingParams(top_p=0.9, seed=4321)], [k])[0].token_id
                  for k in range(40)]
    assert other_seed != alone


def test_unseeded_rows_use_the_process_rng() -> None:
    row = torch.zeros(1, 1000)   # uniform over 1000 tokens
    sampler = Sampler(random.Random(5))
    draws = [sampler.sample(row, [SamplingParams()], [0])[0].token_id for _ in range(30)]
    assert len(set(draws)) > 20


def test_derive_seed() -> None:
    assert derive_seed(42, 0) == 42
    children = [derive_seed(42, i) for i in range(1, 50)]
    assert len(set(children)) == 49 and 42 not in children
    assert children == [derive_seed(42, i) for i in range(1, 50)]
    assert derive_seed(43, 1) != derive_seed(42, 1)
    with pytest.raises(InvalidSamplingParams):
        derive_seed(1, -1)


def test_seeded_uniform_is_uniform_in_unit_interval() -> None:
    values = np.array([seeded_uniform(s, k) for s in range(40) for k in range(50)])
    assert values.min() >= 0.0 and values.max() < 1.0
    counts = np.histogram(values, bins=10, range=(0, 1))[0]
    expected = len(values) / 10
    assert np.all(np.abs(counts - expected) < 5 * math.sqrt(expected))
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) != seeded_uniform(7, 4)


def _reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Independent NumPy version of temperature → top-k → top-p → min-p."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.ones_like(x, dtype=bool)
    if p.top_k is not None:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs)
        mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        keep[order[mass_before >= p.top_p]] = False
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, top_p=0.3),   # the top token alone holds more than 0.3
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=5, top_p=0.8, min_p=0.1),
    ],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}",
)
def test_filtered_distribution_exact_and_sampled(params: SamplingParams) -> None:
    expected = _reference_probs(LOGITS.numpy(), params)
    probs = Sampler().probabilities(LOGITS[None], [params])[0].double().numpy()
    np.testing.assert_array_equal(probs > 0, expected > 0)
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    # Frequencies over seeds 0..N-1 (deterministic): nothing outside the support, and every
    # count within 5 sigma of its expectation.
    n = 3000
    sampler = Sampler()
    seeded = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             min_p=params.min_p, seed=s) for s in range(n)]
    tokens = [t.token_id for t in sampler.sample(LOGITS.expand(n, -1).contiguous(), seeded, [0] * n)]
    counts = np.bincount(tokens, minlength=len(LOGITS))
    assert np.all(counts[expected == 0] == 0)
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 5 * sigma + 1), (counts, n * expected)


def test_top_k_larger_than_vocab_and_top_k_one() -> None:
    wide = Sampler().probabilities(LOGITS[None], [SamplingParams(top_k=100)])[0]
    assert bool((wide > 0).all())
    out = Sampler().sample(LOGITS.expand(20, -1).contiguous(), [SamplingParams(top_k=1, seed=s) for s in range(20)],
                           [0] * 20)
    assert {t.token_id for t in out} == {0}


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.7, seed=3, logprobs=4),
              SamplingParams(seed=4)]
    out = Sampler().sample(logits, params, [0, 0, 0])
    raw = logits.log_softmax(dim=-1)
    assert out[0].logprob == pytest.approx(float(raw[0, out[0].token_id]), abs=1e-6)
    assert out[0].top_logprobs is None
    assert out[1].logprob == pytest.approx(float(raw[1, out[1].token_id]), abs=1e-6)
    top = out[1].top_logprobs
    assert top is not None and [t for t, _ in top] == raw[1].topk(4).indices.tolist()
    assert [v for _, v in top] == pytest.approx(raw[1].topk(4).values.tolist(), abs=1e-6)
    assert out[2].logprob is None and out[2].top_logprobs is None
