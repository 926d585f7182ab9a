"""The one way tests wait for an effect they cannot await directly (a server's own timers, a
heartbeat, a lease expiring, a process becoming healthy).

`check` is a predicate, plain or async; it is called until it returns something truthy, which is
then returned, or the deadline passes and the test fails naming `what`. Waiting on a condition
rather than sleeping a fixed time keeps tests both fast and robust on a busy 2-core machine.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], T | Awaitable[T]], *, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = ""
) -> T:
    """Poll `check()` on the running event loop until truthy; return that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not reached within {timeout_s} s")
        await asyncio.sleep(interval_s)


def eventually_sync(
    check: Callable[[], T], *, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = ""
) -> T:
    """`eventually` for synchronous tests (integration tests driving real processes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not reached within {timeout_s} s")
        time.sleep(interval_s)


__all__ = ["eventually", "eventually_sync"]
