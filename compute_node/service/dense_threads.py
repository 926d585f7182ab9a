"""How many torch threads a CPU node's step uses for its dense layers, chosen per step.

A node told to wait passively (`OMP_WAIT_POLICY=PASSIVE`, for a host whose cores other
processes hold; the node's default is a short spin, `cli.short_omp_spin`). The price of the
passive wait is one wake-up per parallel region: the worker sleeps, the region's caller wakes
it (a futex, on a VM an IPI to a halted vCPU) and then waits for it at the region's end. On the
2-core VM of BENCHMARKS.md that costs ~100-120 us per region (an 8-row matmul of the 135M
model: 144 us spinning, 268 us passive, 171 us on one thread), and a decode step of that
model makes ~120 of them (4 MKL GEMMs per layer, 30 layers, the LM head): 12-15 ms of a
~100 ms dense phase, the gap between the node and the embedded engine (whose threads spin,
libgomp's default) measured in BENCHMARKS.md "Services mode, round 3".

A decode-sized step (few tokens: GEMMs of a few rows, bound by reading the weights) gains
little from a second thread, so the node runs steps of at most `serial_tokens` tokens on one
torch thread (no team, nothing to wake) and larger steps (prefill chunks) on its whole budget,
where the wake-up is small next to the work. Only where the wait is passive: a node told to
spin (`OMP_WAIT_POLICY=ACTIVE`, `GOMP_SPINCOUNT`) keeps its team awake and its budget.

`torch.set_num_threads` is per calling thread for OpenMP and MKL, so this runs on the node's
step thread, before each step; it calls it only when the choice changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedkv.v1 import compute_node_pb2 as pb


def waits_passively(environ: Mapping[str, str]) -> bool:
    """Whether this process's OpenMP threads sleep at once between regions (libgomp read the
    environment when torch loaded; `GOMP_SPINCOUNT` overrides the policy's spin)."""
    return environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" and "GOMP_SPINCOUNT" not in environ


def step_tokens(request: pb.GenerateRequest) -> int:
    """The tokens a Generate computes (the rows of its dense layers' GEMMs)."""
    return sum(len(s.token_ids) for s in request.sequences)


@dataclass(slots=True)
class DenseThreads:
    """Per-step torch thread count: 1 for steps of at most `serial_tokens` tokens, else
    `budget`. `serial_tokens` 0 (or a budget of 1) keeps the budget for every step."""

    budget: int
    serial_tokens: int
    current: int = 0   # what this thread was last set to (0: not set here yet)

    def threads_for(self, num_tokens: int) -> int:
        return 1 if 0 < num_tokens <= self.serial_tokens else self.budget

    def apply(self, num_tokens: int) -> int:
        """Set the calling thread's torch threads for a step of `num_tokens`; returns them."""
        want = self.threads_for(num_tokens)
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        return want


__all__ = ["DenseThreads", "step_tokens", "waits_passively"]
