"""Compile-time shape of an attention kernel variant.

Every attention kernel is built by a cached factory from one `AttentionSpec`: head dim, block
size, KV heads, GQA group, dtypes and the launch shape are constants inside the kernel, so
strides fold into immediates, loops have constant trip counts and per-lane arrays have fixed
sizes (registers, never local memory). A model needs a handful of variants.

Two implementations of the per-warp tile step exist (`path`):
- "tc" — tensor cores (`mma.sync` m16n8k16 / m16n8k8, float32 accumulators) when queries and
  K/V share one 16-bit type and head_dim is a multiple of 16: a few instructions per 16 bytes
  of K/V however many query heads share them;
- "simt" — float32 FMAs with warp-shuffle reductions: float32 caches, mixed query/cache types
  and head dims that are not multiples of 16 (any multiple of 1…8 up to 256, see `simt_vec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels._validate import KernelInputError

WARP = 32
NUM_WARPS = 4  # 128 threads: four independent token streams per thread block
WIDE_HEAD_WARPS = 2  # head_dim > 128: two warps keep the staging buffers under 48 KB
STAGING_BUDGET = 40 * 1024  # bytes of K/V staging per block (48 KB minus the merge state)
MAX_HEAD_DIM = 256
TC_MAX_ROWS = 16  # one m16 tile of query rows
TC_STEP_TOKENS = 16  # two n8 tiles of tokens per warp step
ROW_TILE = 8  # rows merged across warps per pass (one n8 tile of the O^T accumulator)
SIMT_MIN_ROWS = 4  # SIMT steps pad rows to >= 4, so a step is <= 8 tokens
KIND_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
MODES = ("decode", "split", "prefill")


def simt_vec(head_dim: int, kv_kind: str) -> int:
    """Elements of one row each SIMT lane owns: a power of two dividing head_dim, at least
    4 bytes (a 32-bit load) and small enough that 32 lanes cover the row; 0 if none fits."""
    min_vec = max(1, 4 // KIND_BYTES[kv_kind], math.ceil(head_dim / WARP))
    vec = 1
    while vec < min_vec:
        vec *= 2
    return vec if vec <= 8 and head_dim % vec == 0 else 0


@dataclass(slots=True, frozen=True)
class AttentionSpec:
    """One attention kernel variant (see the module docstring)."""

    head_dim: int
    block_size: int
    num_kv_heads: int
    group_size: int
    q_kind: str
    kv_kind: str
    out_kind: str
    mode: str = "decode"

    @property
    def path(self) -> str:
        same_16bit = self.q_kind == self.kv_kind and self.kv_kind in ("f16", "bf16")
        return "tc" if same_16bit and self.head_dim % 16 == 0 else "simt"

    @property
    def num_warps(self) -> int:
        """Warps (token streams) per block: as many as keep each warp's two staged K/V tiles
        (16-byte padded rows) under the 48 KB of shared memory Numba can give a block."""
        if self.path == "tc":
            return NUM_WARPS if self.head_dim <= 128 else WIDE_HEAD_WARPS
        step = self.simt_step
        per_warp = 2 * step * (self.head_dim * KIND_BYTES[self.kv_kind] + 16)
        warps = NUM_WARPS
        while warps > 1 and warps * per_warp > STAGING_BUDGET:
            warps //= 2
        return warps

    @property
    def num_threads(self) -> int:
        return WARP * self.num_warps

    @property
    def simt_step(self) -> int:
        """Tokens per SIMT warp step: (token, row) pairs fill the 32 lanes exactly, with rows
        padded to a power of two and at least 4 (at most 8 tokens: a step's unrolled code and
        its staged tiles stay small)."""
        padded = max(SIMT_MIN_ROWS, 1 << (self.rows - 1).bit_length())
        return WARP // padded

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group_size

    @property
    def max_rows(self) -> int:
        """Query rows one thread block can hold: an m16 tile (tc), or as many as keep a SIMT
        lane's queries and accumulators at <= 32 registers each."""
        if self.path == "tc":  # head_dim > 128: one n8 row tile keeps O and Q in registers
            return TC_MAX_ROWS if self.head_dim <= 128 else ROW_TILE
        return min(16, WARP // simt_vec(self.head_dim, self.kv_kind))

    @property
    def rows(self) -> int:
        """Query rows per thread block: decode holds (part of) one GQA group; prefill fills the
        block with consecutive query tokens x the group's heads."""
        if self.mode == "prefill":  # SIMT: 4 rows keep 8-token steps (fewer shuffles per byte)
            return self.max_rows if self.path == "tc" else min(self.max_rows, SIMT_MIN_ROWS)
        return min(self.group_size, self.max_rows)

    @property
    def row_blocks(self) -> int:
        """Thread blocks per (sequence, KV head) that split a decode GQA group's rows."""
        return math.ceil(self.group_size / self.rows) if self.mode != "prefill" else 1

    @property
    def row_tiles(self) -> int:
        return math.ceil(self.rows / ROW_TILE)


    def check(self) -> None:
        """Reject variants the kernels cannot run, with a readable reason."""
        if self.mode not in MODES:
            raise KernelInputError(f"unknown attention mode {self.mode!r}")
        if not 4 <= self.head_dim <= MAX_HEAD_DIM or self.head_dim % 4:
            raise KernelInputError(
                f"the cuda backend supports head_dim 4..{MAX_HEAD_DIM} in multiples of 4, "
                f"got {self.head_dim}")
        if self.path == "simt" and simt_vec(self.head_dim, self.kv_kind) == 0:
            raise KernelInputError(
                f"head_dim {self.head_dim} is not supported by the cuda backend for "
                f"{self.kv_kind} caches (a multiple of 16 always is)")
        if self.block_size < 1 or self.num_kv_heads < 1 or self.group_size < 1:
            raise KernelInputError("block_size, num_kv_heads and group_size must be >= 1")
