"""Timing that separates the kernels from the host (bench/gpu_check.py; issue 43 item 4).

The 2026-12-04 run timed each call as `start.record(); fn(); end.record()` from an idle stream,
so the start event fired before the Python of `fn` had launched anything and every direct cell
carried 80–260 µs of host time. Here each call is measured four ways:

- `kernel_us`: the GPU time of the call's launches only. The stream is first given a spin
  kernel (`torch.cuda._sleep`) longer than the call's Python, then the start event, the call,
  the end event: the start event fires when the spin ends, by which time the call's kernels
  are queued behind it, so the pair brackets the kernels and nothing of the host. Whether the
  spin outlasted the host is checked per call (`primed`: False means the number includes host).
- `back_to_back_us`: N calls between one event pair, per call: the throughput a caller that
  never synchronises sees (the kernel time when the host keeps ahead, else the host's pace).
- `host_us`: Python microseconds per call measured on the CPU (no synchronisation);
- `latency_us`: one call from an idle stream to the end of its kernels, synchronised: what a
  synchronous caller waits (the old method, host and kernel together).

On the CPU (`Timer(torch, "cpu")`, the --cpu-smoke run) events are wall-clock stand-ins and the
spin is a no-op, so the same code runs end to end without a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class _WallEvent:
    """A CPU stand-in for torch.cuda.Event (the smoke run)."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _WallEvent) -> float:
        return (end.at - self.at) * 1e3


class Timer:
    """Events, synchronisation and a calibrated spin on one device ("cuda" or "cpu")."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.cuda = device == "cuda"
        self._cycles_per_us: float | None = None

    def event(self) -> Any:
        if self.cuda:
            return self.torch.cuda.Event(enable_timing=True)
        return _WallEvent()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def can_spin(self) -> bool:
        return self.cuda and hasattr(self.torch.cuda, "_sleep")

    def cycles_per_us(self) -> float:
        """The spin kernel's rate, measured once (clock rates vary with boost and load)."""
        if self._cycles_per_us is None:
            cycles = 2_000_000
            self.torch.cuda._sleep(cycles)  # warm
            start, end = self.event(), self.event()
            start.record()
            self.torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_us = cycles / max(start.elapsed_time(end) * 1e3, 1.0)
        return self._cycles_per_us

    def spin(self, us: float) -> None:
        """Keep the stream busy for about `us` microseconds (no-op without a GPU)."""
        if self.can_spin():
            self.torch.cuda._sleep(int(us * self.cycles_per_us()))


@dataclass(slots=True)
class CallTimes:
    """One launch path's numbers (µs per call; module doc)."""

    kernel_us: float
    back_to_back_us: float
    host_us: float
    primed: bool  # the spin outlasted the host in every kernel_us repetition
    reps: int
    latency_us: float = 0.0  # one call from an idle stream to its end (a synchronous caller)

    def as_row(self, prefix: str = "") -> dict[str, Any]:
        return {f"{prefix}kernel_us": self.kernel_us, f"{prefix}b2b_us": self.back_to_back_us,
                f"{prefix}host_us": self.host_us, f"{prefix}latency_us": self.latency_us,
                f"{prefix}primed": self.primed}


MAX_SPIN_US = 20_000.0  # a first call that compiled a kernel must not set a seconds-long spin


def time_call(timer: Timer, fn: Callable[[int], Any], reps: int, *, warmup: int = 2,
              b2b_calls: int | None = None, spin_us: float = 1000.0) -> CallTimes:
    """Measure `fn(i)` (i = repetition index, to rotate inputs) the four ways of the module
    doc. The spin is lengthened to 3x the last warm-up call's host time when that is longer
    (the first may include a JIT compile), up to MAX_SPIN_US; `primed` says whether it held."""
    host = []
    for i in range(warmup):
        t0 = time.perf_counter()
        fn(i)
        host.append((time.perf_counter() - t0) * 1e6)
    timer.sync()
    spin = min(MAX_SPIN_US, max(spin_us, 3 * host[-1] if host else 0.0))
    host = host[1:]  # the first call's JIT and allocations are not the path's cost
    pairs, primed = [], True
    for i in range(reps):
        timer.spin(spin)
        start, end = timer.event(), timer.event()
        start.record()
        t0 = time.perf_counter()
        fn(i)
        took = (time.perf_counter() - t0) * 1e6
        end.record()
        host.append(took)
        primed = primed and took < spin
        pairs.append((start, end))
    timer.sync()
    kernel_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)
    calls = b2b_calls or max(reps, 10)
    start, end = timer.event(), timer.event()
    start.record()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    loop_us = (time.perf_counter() - t0) * 1e6
    end.record()
    timer.sync()
    b2b = start.elapsed_time(end) * 1e3 / calls
    host_us = min(statistics.median(host), loop_us / calls)
    latency = []  # the 2026-12-04 method: host and kernel together, from an idle stream
    for i in range(min(reps, 5)):
        start, end = timer.event(), timer.event()
        start.record()
        fn(i)
        end.record()
        timer.sync()
        latency.append(start.elapsed_time(end) * 1e3)
    return CallTimes(kernel_us, b2b, host_us, primed and timer.can_spin(), reps,
                     statistics.median(latency) if latency else 0.0)


def reps_for(est_us: float, target_us: float = 20_000.0, lo: int = 5, hi: int = 30) -> int:
    """Repetitions so one measurement costs about `target_us` of GPU time, within [lo, hi]."""
    if est_us <= 0:
        return hi
    return int(min(hi, max(lo, target_us // est_us)))


def copy_gbs(torch: Any, timer: Timer, device: str, nbytes: int = 4 << 30) -> float:
    """GB/s of a device-to-device copy of `nbytes`, counting bytes read + written."""
    buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    times = time_call(timer, lambda _: buffers[1].copy_(buffers[0]), reps=5, b2b_calls=5)
    buffers.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (min(times.kernel_us, times.back_to_back_us) * 1e-6) / 1e9


def gbs(nbytes: float, us: float | None) -> float | None:
    """Bytes per microsecond as GB/s (None when there is no time)."""
    return nbytes / (us * 1e-6) / 1e9 if us else None
