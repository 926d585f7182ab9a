"""Prompt scoring on the node (`SeqWork.prompt_logprobs`, `ModelRunner.run_step`): the scores of a
mixed step (decodes first in row order, prefill chunks scored from their first row or from
the middle) equal the log-softmax of the same rows' logits (`debug_forward`, the same batch
on a fresh pool), and a bad request is refused before anything is written."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import compute_node.model.runner as runner_module
from compute_node.model import InvalidBatch, ModelRunner, PromptLogprobsRequest, SamplingParams, SeqWork
from tests.compute_node.model.model_helpers import tiny_model_dir

SPEC = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
        "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 64}
BLOCK = 4
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("scoring"), "llama", seed=5, **SPEC)


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, block_size=BLOCK, num_blocks=40, device="cpu")


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, SPEC["vocab_size"]) for _ in range(n)]


def test_scores_are_the_rows_log_softmax(model_dir: Path) -> None:
    a, b = _ids(9, 1), _ids(7, 2)
    batch = [
        # a whole prompt, scored from its first row; the last row samples
        SeqWork("a", a, 0, [0, 1, 2], GREEDY, 0, PromptLogprobsRequest(0, tuple(a[1:]), 3)),
        # a middle chunk (no sample) scored from its third row to its last
        SeqWork("b", b, 0, [3, 4], None, 0, PromptLogprobsRequest(2, (11, 12, 13, 14, 15), 0)),
        SeqWork("d", [9], 0, [5], GREEDY),                                     # a decode: row 0
    ]
    result = _runner(model_dir).run_step(batch)
    assert [o is not None for o in result.outputs] == [True, False, True]
    logits = _runner(model_dir).debug_forward(batch).logits
    rows = {"a": (0, batch[0]), "b": (9 + 2, batch[1])}   # batch order: a's 9 rows, then b's
    assert [s.seq_id for s in result.prompt_logprobs] == ["a", "b"]
    for scored in result.prompt_logprobs:
        first, work = rows[scored.seq_id]
        req = work.prompt_logprobs
        assert req is not None and len(scored.logprobs) == len(scored.ranks) == len(scored.top) == len(
            req.target_token_ids)
        for i, target in enumerate(req.target_token_ids):
            ref = logits[first + i].log_softmax(dim=-1)
            assert scored.logprobs[i] == pytest.approx(float(ref[target]), abs=1e-5)
            assert scored.ranks[i] == int((ref > ref[target]).sum()) + 1
            top = torch.topk(ref, req.num_top)
            assert [t for t, _ in scored.top[i]] == top.indices.tolist()
            assert [lp for _, lp in scored.top[i]] == pytest.approx(top.values.tolist(), abs=1e-5)
    # the sampled token is the last row's argmax: the same pass
    out = result.outputs[0]
    assert out is not None and out.token_id == int(logits[8].argmax())
    assert _runner(model_dir).run_step([SeqWork("x", [5, 6], 0, [0])]).prompt_logprobs == []


@pytest.mark.parametrize("request_, why", [
    (PromptLogprobsRequest(0, (), 0), "no target"),
    (PromptLogprobsRequest(1, (5, 6, 7, 8), 0), "past the new tokens"),
    (PromptLogprobsRequest(-1, (5,), 0), "before the new tokens"),
    (PromptLogprobsRequest(0, (300,), 0), "outside the vocabulary"),
    (PromptLogprobsRequest(0, (5,), 21), "too many top tokens"),
    ("0:5", "not a request"),
])
def test_a_bad_request_is_refused_before_writing(model_dir: Path, request_: object, why: str) -> None:
    runner = _runner(model_dir)
    before = [c.clone() for c in runner.pool.key_caches]
    with pytest.raises(InvalidBatch):
        runner.run_step([SeqWork("x", [5, 6, 7, 8], 0, [0], GREEDY, 0, request_)])   # type: ignore[arg-type]
    assert all(torch.equal(x, y) for x, y in zip(before, runner.pool.key_caches)), why


def test_no_request_no_extra_logits(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head runs over the sampled rows only, unless an item asks for prompt scores; then
    over its scored rows too (in slices of PROMPT_LOGITS_ROWS)."""
    runner = _runner(model_dir)
    rows: list[int] = []
    real = runner.model.logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(runner.model, "logits", counting)
    monkeypatch.setattr(runner_module, "PROMPT_LOGITS_ROWS", 4)
    a = _ids(12, 3)
    runner.run_step([SeqWork("a", a[:6], 0, [0, 1], None), SeqWork("d", [9], 0, [5], GREEDY)])
    assert rows == [1]
    rows.clear()
    runner.run_step([SeqWork("a", a[6:], 6, [0, 1, 2], GREEDY, 0, PromptLogprobsRequest(6, tuple(a[7:]), 2))])
    assert rows == [1, 4, 1]
