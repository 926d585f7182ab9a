"""A model node runs every step on its one step thread, where its thread budget holds (issue 21:
steps on varying pool threads kept several OpenMP teams alive and escaped the Numba budget)."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.engine.node_steps import run_node_steps

MODEL = "llama-gqa4-hd64"


def test_every_generate_runs_on_the_nodes_step_thread_with_its_budget(model_dirs: dict[str, Path]) -> None:
    prompts = [[3 + i, 5, 7, 11 + i] for i in range(3)]
    node, calls, loop_thread = run_node_steps(model_dirs[MODEL], {"threads": 1}, prompts, max_tokens=6)
    assert node.num_threads == 1
    assert len(calls) >= 6
    assert {c.thread for c in calls} == {node.step_thread.ident}
    assert node.step_thread.ident not in (loop_thread, threading.get_ident())
    assert all((c.torch_threads, c.numba_threads) == (1, 1) for c in calls), calls   # torch and Numba capped there
