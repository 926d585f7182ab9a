"""Compile-time shape of an attention kernel variant, and its shared-memory budget.

Every attention kernel is built by a cached factory from one `AttentionSpec`, so head dim,
block size, GQA group size, dtypes and thread count are constants inside the kernel (loops
unroll, index arithmetic folds, local arrays get fixed sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels._validate import KernelInputError

# Numba cannot launch with more than 48 KB of (static or dynamic) shared memory per block.
MAX_SHARED_BYTES = 48 * 1024
# Tokens per staged K/V tile: a whole block when it is small, else a divisor of it.
MAX_TILE_TOKENS = 32
# Query rows (query tokens x heads of one GQA group) one prefill thread block handles.
PREFILL_ROWS = 16
DEFAULT_PREFETCH_WINDOW = 8
# K (and V) elements each thread holds in registers for the next tile. Beyond ~16 the
# unrolled prefetch arrays spill to local memory (seen in the sm_90 PTX), so larger blocks
# are staged as several tiles.
MAX_TILE_ELEMS_PER_THREAD = 16
# float32 output accumulators per thread. 16 (prefill: 16 rows x 128 dims over 128 threads)
# already lands in local memory in the sm_90 PTX, so wide variants get more threads instead.
MAX_ACC_ELEMS_PER_THREAD = 8
MAX_THREADS = 1024


@dataclass(slots=True, frozen=True)
class AttentionSpec:
    """One attention kernel variant.

    `query_tile` is 1 for decode; for prefill it is how many query tokens of one sequence
    share a thread block (so K/V tiles are staged once for `query_tile * group_size` rows).
    """

    head_dim: int
    block_size: int
    group_size: int
    q_kind: str
    kv_kind: str
    out_kind: str
    num_threads: int
    prefetch_window: int = DEFAULT_PREFETCH_WINDOW
    query_tile: int = 1

    @property
    def num_rows(self) -> int:
        return self.group_size * self.query_tile

    @property
    def score_split(self) -> int:
        """Threads that share one (row, token) dot product when there are few pairs.

        With one query row (MHA decode) a 16-token tile has only 16 dot products; splitting
        each over several lanes keeps all threads busy instead of 16.
        """
        pairs = self.num_rows * self.tile_tokens
        split = 1
        while split * 2 * pairs <= self.num_threads and split * 2 <= self.head_dim:
            split *= 2
        return split

    @property
    def tile_tokens(self) -> int:
        """Largest divisor of block_size, at most 32, whose staging fits in shared memory and
        in MAX_TILE_ELEMS_PER_THREAD prefetch registers per thread."""
        for tokens in range(min(self.block_size, MAX_TILE_TOKENS), 0, -1):
            fits_registers = tokens * self.head_dim <= MAX_TILE_ELEMS_PER_THREAD * self.num_threads
            fits_shared = self._shared_bytes(tokens) <= MAX_SHARED_BYTES
            if self.block_size % tokens == 0 and fits_registers and fits_shared:
                return tokens
        raise KernelInputError(
            f"head_dim {self.head_dim} with {self.num_rows} query rows does not fit the "
            f"{MAX_SHARED_BYTES} B shared-memory budget of the cuda backend"
        )

    def _shared_bytes(self, tokens: int) -> int:
        d, r = self.head_dim, self.num_rows
        pairs = r * tokens
        split = max(1, self.num_threads // max(pairs, 1))
        floats = (
            tokens * (d + 1)  # K tile, padded rows
            + tokens * d  # V tile
            + max(pairs * split, pairs)  # partial scores
            + r * tokens  # probabilities
            + r * d  # scaled queries
            + 4 * r  # alpha, running max, running sum, limits
        )
        return 4 * (floats + self.prefetch_window)

    @property
    def tile_elems_per_thread(self) -> int:
        return math.ceil(self.tile_tokens * self.head_dim / self.num_threads)

    @property
    def acc_elems_per_thread(self) -> int:
        return math.ceil(self.num_rows * self.head_dim / self.num_threads)

    def check(self) -> None:
        """Reject variants the kernels cannot run, with a readable reason."""
        if self.num_threads % 32 != 0 or not 32 <= self.num_threads <= 1024:
            raise KernelInputError(
                f"num_threads must be a multiple of 32 in [32, 1024], got {self.num_threads}"
            )
        if self.num_rows > self.num_threads:
            raise KernelInputError(
                f"{self.num_rows} query rows per thread block exceed {self.num_threads} threads"
            )
        if self.prefetch_window < 1:
            raise KernelInputError("prefetch_window must be >= 1")
        _ = self.tile_tokens


def threads_for(num_rows: int, head_dim: int, base: int) -> int:
    """Threads per block: `base`, doubled until each thread holds <= MAX_ACC_ELEMS_PER_THREAD
    accumulators (so they stay in registers)."""
    threads = base
    while num_rows * head_dim > MAX_ACC_ELEMS_PER_THREAD * threads and threads < MAX_THREADS:
        threads *= 2
    return threads


def prefill_query_tile(group_size: int) -> int:
    """Query tokens per prefill thread block: fill PREFILL_ROWS rows (at least one token)."""
    return max(1, PREFILL_ROWS // group_size)
