"""A CPU node that waits passively runs decode-sized steps on one torch thread and larger ones
on its budget (issue 21: a sleeping OpenMP worker costs a wake-up per parallel region, ~120 per
decode step of the 135M model; BENCHMARKS.md "Services mode, round 3")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compute_node.service.dense_threads import DenseThreads, step_tokens, waits_passively
from pagedkv.v1 import compute_node_pb2 as pb
from tests.engine.node_steps import StepCall, run_node_steps

MODEL = "llama-gqa4-hd64"


def test_the_choice_is_one_thread_up_to_the_threshold_else_the_budget() -> None:
    d = DenseThreads(budget=4, serial_tokens=8)
    assert [d.threads_for(n) for n in (1, 8, 9, 512)] == [1, 1, 4, 4]
    assert DenseThreads(budget=4, serial_tokens=0).threads_for(1) == 4   # off


def test_apply_sets_the_calling_threads_count_only_when_it_changes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    d = DenseThreads(budget=2, serial_tokens=8, current=2)
    assert [d.apply(n) for n in (100, 8, 8, 3, 9, 64, 1)] == [2, 1, 1, 1, 2, 2, 1]
    assert calls == [1, 2, 1]


def test_only_a_passive_wait_counts() -> None:
    assert waits_passively({"OMP_WAIT_POLICY": "PASSIVE"})
    assert waits_passively({"OMP_WAIT_POLICY": "passive"})
    assert not waits_passively({})
    assert not waits_passively({"OMP_WAIT_POLICY": "ACTIVE"})
    assert not waits_passively({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"})


def test_step_tokens_counts_every_sequences_new_tokens() -> None:
    req = pb.GenerateRequest(sequences=[pb.GenerateSequence(seq_id="a", token_ids=[1, 2, 3]),
                                        pb.GenerateSequence(seq_id="b", token_ids=[4])])
    assert step_tokens(req) == 4


def _run(model_dir: Path, node: dict[str, Any]) -> tuple[Any, list[StepCall]]:
    # 3 prompts of 6 tokens: an 18-token prefill step, then 3-token decodes
    prompts = [[3 + i, 5, 7, 11 + i, 13, 17] for i in range(3)]
    cn, calls, _ = run_node_steps(model_dir, node, prompts, max_tokens=5)
    return cn, calls


def test_a_passive_node_runs_decode_steps_on_one_thread_and_prefill_on_its_budget(
        model_dirs: dict[str, Path], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    node, calls = _run(model_dirs[MODEL], {"threads": 2, "serial_dense_tokens": 4})
    assert node.dense_threads is not None
    assert {c.thread for c in calls} == {node.step_thread.ident}
    assert any(c.num_tokens > 4 for c in calls) and any(c.num_tokens <= 4 for c in calls), calls
    assert all(c.torch_threads == (1 if c.num_tokens <= 4 else 2) for c in calls), calls


def test_a_spinning_node_or_a_zero_threshold_keeps_the_budget_for_every_step(
        model_dirs: dict[str, Path], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    node, calls = _run(model_dirs[MODEL], {"threads": 2, "serial_dense_tokens": 0})
    assert node.dense_threads is None and calls and all(c.torch_threads == 2 for c in calls), calls
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    node, calls = _run(model_dirs[MODEL], {"threads": 2})
    assert node.dense_threads is None and calls and all(c.torch_threads == 2 for c in calls), calls
