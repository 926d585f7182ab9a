"""Compiled loops of the core's hot path (Numba `@njit` over the int64 columns).

Why compiled: a Step's per-sequence work that is not a plain array expression — walking the
free list block by block, in request order — costs a Python method call and a dozen list
operations per block when written in Python. Here it is one call per batch.

Cold start: the functions are compiled on first use (a few hundred ms) and cached on disk
(`cache=True`, in `__pycache__` beside this file, or `NUMBA_CACHE_DIR`), so a fresh process
loads machine code instead (tens of ms). Where no cache directory is writable (a read-only
install), Numba refuses `cache=True`: the same functions are then compiled in memory on first
use, once per process. Numba itself is imported only when a batch first needs these loops
(`kernels()`), so importing the core stays as cheap as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_NIL = -1

# Runs shorter than this stay in Python (block_list.py): per block the compiled loop saves a
# fraction of a µs, and the first compiled call of a process costs ~0.5-1 s (importing Numba,
# initialising LLVM, loading the cached machine code; measured on a 2-core VM). A decode step
# takes a few blocks; an admission of a long prompt, or a large batch of them, many.
COMPILED_MIN_BLOCKS = 64


def pop_front_n(prev: np.ndarray, nxt: np.ndarray, head: int, ref: np.ndarray, out: np.ndarray) -> None:
    """Pop `len(out)` blocks off the front of the list `(prev, nxt, head)` into `out`, in list
    order, each given ref_cnt 1 (what `Pool.take_block` does to a plain free block). The caller
    checked the list holds that many and adjusts its length."""
    b = nxt[head]
    for i in range(out.shape[0]):
        after = nxt[b]
        prev[b] = _NIL
        nxt[b] = _NIL
        ref[b] = 1
        out[i] = b
        b = after
    nxt[head] = b
    prev[b] = head


def push_front_rev(prev: np.ndarray, nxt: np.ndarray, head: int, ref: np.ndarray, blocks: np.ndarray) -> None:
    """Undo `pop_front_n` for `blocks` (popped in that order): back at the front, in the same
    order, ref_cnt 0 again."""
    for i in range(blocks.shape[0] - 1, -1, -1):
        b = blocks[i]
        first = nxt[head]
        prev[b] = head
        nxt[b] = first
        prev[first] = b
        nxt[head] = b
        ref[b] = 0


@dataclass(frozen=True, slots=True)
class Kernels:
    """The compiled functions (Numba dispatchers; plain Python functions with `jit=False`)."""

    pop_front_n: Any
    push_front_rev: Any
    cached: bool   # whether the machine code is cached on disk


_KERNELS: Kernels | None = None


def _compile(fn: Any) -> tuple[Any, bool]:
    from numba import njit  # (lazily: the core imports without Numba's start-up cost)

    try:
        return njit(cache=True, nogil=True)(fn), True
    except RuntimeError:   # "cannot cache function ...: no locator available" (read-only tree)
        return njit(nogil=True)(fn), False


def kernels() -> Kernels:
    """The compiled kernels, built (or loaded from the disk cache) on first use."""
    global _KERNELS
    if _KERNELS is None:
        pop, c1 = _compile(pop_front_n)
        push, c2 = _compile(push_front_rev)
        _KERNELS = Kernels(pop, push, c1 and c2)
    return _KERNELS


def warm_up() -> Kernels:
    """Load (or compile) the kernels now: a server calls this at start so that its first long
    run of blocks does not pay Numba's start-up."""
    k = kernels()
    empty = np.empty(0, np.int64)
    links = np.full(2, -1, np.int64)
    k.pop_front_n(links, links.copy(), 1, empty.copy(), empty)
    k.push_front_rev(links, links.copy(), 1, empty.copy(), empty)
    return k


__all__ = ["COMPILED_MIN_BLOCKS", "Kernels", "kernels", "pop_front_n", "push_front_rev", "warm_up"]
