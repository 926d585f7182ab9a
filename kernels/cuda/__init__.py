"""Numba CUDA backend of the paged-KV kernels.

The public dispatcher (`kernels/__init__.py`) validates arguments, then calls these four
functions with the public parameters minus `backend`. Data must live on the GPU (CUDA torch
tensors, viewed zero-copy, or Numba device arrays; host index arrays are copied over); under
`NUMBA_ENABLE_CUDASIM=1` NumPy arrays and CPU torch tensors run in Numba's simulator.

Decisions:
- Attention: one thread block per (sequence, KV head[, partition]) so a GQA group's K/V is read
  once; K/V tiles staged in shared memory (float32, padded rows), the next tile prefetched into
  registers, block-table entries staged `prefetch_window` at a time; online softmax in
  float32. Split-K + reduce for few long sequences (rule: `decode.choose_num_partitions`).
- Reductions use shared memory and barriers, no warp shuffles: the simulator has none, and a
  per-(row, token) dot product split over a few lanes needs only one extra summation pass.
- bf16: torch bf16 does not cross the CUDA array interface, so it is passed as its int16 bits;
  kernels widen it to float32 (bit shift) and round float32 outputs to nearest even.
- Kernel variants come from cached factories keyed by `AttentionSpec` (head dim, block size,
  group size, dtypes, threads, prefetch window): all shapes are compile-time constants.
- copy_blocks keeps sequential pair semantics by grouping dependent pairs into waves.
"""

from kernels.cuda.block_copy import copy_blocks
from kernels.cuda.decode import paged_attention_decode
from kernels.cuda.prefill import paged_prefill_attention
from kernels.cuda.slot_write import write_slots

__all__ = ["copy_blocks", "paged_attention_decode", "paged_prefill_attention", "write_slots"]
