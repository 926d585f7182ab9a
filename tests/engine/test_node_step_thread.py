"""A model node runs every step on its one step thread, where its thread budget holds (issue 21:
steps on varying pool threads kept several OpenMP teams alive and escaped the Numba budget)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numba
import torch

from engine.params import SamplingParams
from tests.engine.services import Services

MODEL = "llama-gqa4-hd64"


class _Spy:
    """The node's Generator, recording the thread (and its thread counts) of every step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, *args: Any) -> Any:
        self.calls.append((threading.get_ident(), torch.get_num_threads(), numba.get_num_threads()))
        return self.inner.generate(*args)


def test_every_generate_runs_on_the_nodes_step_thread_with_its_budget(model_dirs: dict[str, Path]) -> None:
    torch_before = torch.get_num_threads()
    services = Services(model_dirs[MODEL], num_nodes=1, bm={}, node={"threads": 1})
    engine = None
    try:
        node = services.nodes[0].node
        assert node is not None and node.num_threads == 1
        spy = node.generator = _Spy(node.generator)   # type: ignore[assignment]
        engine = services.engine(async_scheduling=False)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i in range(3):
            engine.add_request([3 + i, 5, 7, 11 + i], params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.flush()
        assert len(spy.calls) >= 6
        assert {ident for ident, _, _ in spy.calls} == {node.step_thread.ident}
        assert node.step_thread.ident not in (services.thread.ident, threading.get_ident())
        assert all((t, n) == (1, 1) for _, t, n in spy.calls), spy.calls   # torch and Numba capped there
    finally:
        if engine is not None:
            engine.close()
        services.close()
        torch.set_num_threads(torch_before)
