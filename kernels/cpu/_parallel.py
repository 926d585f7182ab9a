"""How the CPU kernels' `prange` loops are run: how many threads, and how work is handed out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numba

# Work (tokens x heads for attention, bytes for copies) below which one thread runs the loop.
# Starting a parallel region means waking the other worker threads; on a busy host that can
# cost a whole scheduler time slice (measured: a 1-sequence x 512-token decode took 24 ms p50
# with 2 threads vs 1.3 ms with 1 while other processes loaded both cores), and on an idle
# host it still costs tens of microseconds. Below these sizes one core finishes in about a
# millisecond, so the parallel speed-up cannot pay for the risk.
SERIAL_MAX_ATTENTION_WORK = 2**15  # ≈ 1 ms of single-core attention
SERIAL_MAX_COPY_BYTES = 4 * 2**20  # ≈ 0.5 ms of single-core copying


@contextmanager
def parallel_section(serial: bool, chunk_size: int = 1) -> Iterator[None]:
    """Run the enclosed kernel on one thread (`serial`) or on all, handing out `chunk_size`
    prange iterations at a time (0: Numba's default equal static slices, right for uniform
    copies).

    Dynamic hand-out (the attention default) rather than equal static slices because attention work items are ragged
    (sequence lengths differ by orders of magnitude): static slicing would leave a core idle
    while another finishes the long sequences. Items are heavy (at least one K/V block each),
    so the per-chunk overhead is noise. Both settings are thread-local and restored on exit.
    """
    previous_threads = numba.get_num_threads()
    previous_chunk = numba.get_parallel_chunksize()
    if serial:
        numba.set_num_threads(1)
    numba.set_parallel_chunksize(chunk_size)
    try:
        yield
    finally:
        numba.set_parallel_chunksize(previous_chunk)
        numba.set_num_threads(previous_threads)
