"""The in-process node loads its model and computes every step on one thread of its own, whoever
calls (engine/local_node.py: libgomp keeps a thread team per calling thread, and steps on a
second thread ran ~25% slower on a 2-core host), and `StepThread.call` hands work over and back."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from compute_node.service.step_thread import StepThread
from engine.llm import LLM
from engine.local_node import LocalNode
from engine.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_step_thread_call_returns_raises_and_runs_inline_on_itself() -> None:
    thread = StepThread("t")
    try:
        where = thread.call(threading.get_ident)
        assert where != threading.get_ident() and thread.ident == where
        assert thread.call(lambda: thread.call(threading.get_ident)) == where   # inline, no deadlock
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0)
        assert thread.call(sum, [1, 2, 3]) == 6   # still serving after an exception
    finally:
        thread.close()


def test_the_model_loads_and_every_step_runs_on_the_nodes_thread(model_dirs: dict[str, Path]) -> None:
    with LLM(model_dirs["llama-gqa4-hd64"], block_size=4, num_kv_blocks=64, device="cpu") as llm:
        node = llm.engine.nodes["local-0"]
        assert isinstance(node, LocalNode)
        loaded_on = node.thread.ident
        assert loaded_on is not None and loaded_on != threading.get_ident()
        seen: set[int] = set()
        run_step = node.runner.run_step

        def recording(batch):   # type: ignore[no-untyped-def]
            seen.add(threading.get_ident())
            return run_step(batch)

        node.runner.run_step = recording   # type: ignore[method-assign]
        first = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], GREEDY)
        other: list = []
        caller = threading.Thread(target=lambda: other.extend(llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}],
                                                                           GREEDY)))
        caller.start()
        caller.join()
        assert seen == {loaded_on}
        assert other and other[0].outputs[0].token_ids == first[0].outputs[0].token_ids
