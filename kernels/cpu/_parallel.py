"""Scheduling helper for the CPU kernels' `prange` loops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numba


@contextmanager
def dynamic_schedule(chunk_size: int = 1) -> Iterator[None]:
    """Hand out prange iterations `chunk_size` at a time instead of in equal static slices.

    Attention work items are ragged (sequence lengths differ by orders of magnitude): static
    slicing would leave a core idle while another finishes the long sequences. Items are heavy
    (at least one K/V block each), so per-chunk scheduling overhead is noise.
    """
    previous = numba.get_parallel_chunksize()
    numba.set_parallel_chunksize(chunk_size)
    try:
        yield
    finally:
        numba.set_parallel_chunksize(previous)
