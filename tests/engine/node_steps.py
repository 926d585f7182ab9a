"""One model node over real gRPC, driven by the engine, with every step it ran recorded on the
thread that ran it: which thread, how many tokens, and the torch and Numba thread counts in
effect there (both are per calling thread, which is what the node's step-thread tests pin)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import torch

from compute_node.service.dense_threads import step_tokens
from engine.params import SamplingParams
from pagedkv.v1 import compute_node_pb2 as pb
from tests.engine.services import Services


@dataclass(slots=True, frozen=True)
class StepCall:
    thread: int
    num_tokens: int
    torch_threads: int
    numba_threads: int


@dataclass(slots=True)
class StepSpy:
    """Stands in for the node's Generator: records each step, then runs it."""

    inner: Any
    calls: list[StepCall] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, request: pb.GenerateRequest, *args: Any) -> Any:
        self.calls.append(StepCall(threading.get_ident(), step_tokens(request), torch.get_num_threads(),
                                   numba.get_num_threads()))
        return self.inner.generate(request, *args)


def run_node_steps(model_dir: Path, node: dict[str, Any], prompts: list[list[int]],
                   max_tokens: int) -> tuple[Any, list[StepCall], int]:
    """Serve `prompts` (greedy, `max_tokens` each) on one node configured by `node`; the node,
    its recorded steps, and the ident of the thread that ran the services' event loop."""
    torch_before = torch.get_num_threads()
    services = Services(model_dir, num_nodes=1, bm={}, node=node)
    engine = None
    try:
        cn = services.nodes[0].node
        if cn is None:
            raise RuntimeError("the node did not start")
        spy = cn.generator = StepSpy(cn.generator)
        engine = services.engine(async_scheduling=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.flush()
        return cn, spy.calls, services.thread.ident or 0
    finally:
        if engine is not None:
            engine.close()
        services.close()
        torch.set_num_threads(torch_before)
