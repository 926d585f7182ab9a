"""The node's step thread: one long-lived thread that runs every model step of the node.

The event loop must stay free while a step computes (health checks, heartbeats), so the kernels
run off it. They used to run on `asyncio.to_thread`, i.e. on whichever worker of the loop's
default pool picked the job up, and successive steps landed on different threads. That costs on
a CPU node in two ways (measured, BENCHMARKS.md "Services mode: the node's step thread"):

- torch's intra-op pool and Numba's are OpenMP (libgomp), which keeps one thread team per
  calling thread: steps on k different threads keep k teams alive, libgomp then counts more
  threads than cores and throttles its spin-wait, and every parallel region pays a wake-up that
  the embedded engine (always the same thread) does not;
- Numba's `set_num_threads` is per calling thread: the node's thread budget
  (`compute_node.threads`) applied on the thread that loaded the model did not hold on the
  others, so two nodes capped at one thread each still ran the attention kernels on every core.

So a node owns one thread (a one-worker executor): the model load (where the budget is applied),
the kernel warm-up and every Generate / Forward compute run there, in submission order.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class StepThread:
    """Runs blocking calls one at a time on a single dedicated thread (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident: int | None = None

    @property
    def ident(self) -> int | None:
        """The thread's id once it ran something (`threading.get_ident()` there)."""
        return self._ident

    def _call(self, ctx: contextvars.Context, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        self._ident = threading.get_ident()
        return ctx.run(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the step thread (with the caller's context variables, as
        `asyncio.to_thread` does); the caller's event loop keeps running meanwhile."""
        loop = asyncio.get_running_loop()
        call = functools.partial(self._call, contextvars.copy_context(), fn, args)
        return await loop.run_in_executor(self._executor, call)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the step thread, the caller blocked until it returns (its exception
        raised here); run inline when the caller is the step thread itself. For callers that are
        not event loops (the engine's in-process node)."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        return self._executor.submit(self._call, contextvars.copy_context(), fn, args).result()

    def close(self) -> None:
        """Stop taking work; a call already running finishes on its own (not waited for)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["StepThread"]
