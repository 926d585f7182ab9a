"""A node's thread budget: how many threads its torch and Numba pools may use.

Both libraries default to every core of the host. Two nodes on one host then each run a pool of
all cores, and they fight over them (measured on a 2-core host: two nodes slower than one). A
node therefore takes `threads` (`PAGEDKV_CN_THREADS`) or, unset, its share of the host:
cores / `nodes_per_host` (`PAGEDKV_CN_NODES_PER_HOST`, 1 unless the deployment says otherwise;
docker-compose.yml says 2 for its two CPU nodes).
"""

from __future__ import annotations

import os


def thread_budget(threads: int | None, nodes_per_host: int, num_cores: int | None = None) -> int:
    """The node's threads: `threads` when set, else its share of the host's cores (>= 1)."""
    if threads is not None:
        return threads
    cores = num_cores if num_cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // max(1, nodes_per_host))


def apply_thread_budget(threads: int) -> int:
    """Cap torch's intra-op pool and Numba's parallel pool at `threads`; what was applied
    (Numba's pool cannot grow past the size it started with)."""
    import numba
    import torch

    torch.set_num_threads(threads)
    numba_threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(numba_threads)
    return numba_threads


__all__ = ["apply_thread_budget", "thread_budget"]
