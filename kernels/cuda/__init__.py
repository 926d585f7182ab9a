"""Numba CUDA backend of the paged-KV kernels.

The public dispatcher (`kernels/__init__.py`) validates arguments, then calls these four
functions with the public parameters minus `backend`. Data must live on the GPU (CUDA torch
tensors or Numba device arrays; host index arrays are copied over through pinned memory); under
`NUMBA_ENABLE_CUDASIM=1` NumPy arrays and CPU torch tensors run in Numba's simulator.

Design (issue 13; machine-code budgets checked by `bench/kernel_sass.py`):
- Kernels take raw device addresses and compile-time geometry (`AttentionSpec`): one 64-bit
  base per cache block, 32-bit offsets, constant strides and trip counts, no Numba array
  indexing (no per-element wraparound checks) in any hot loop.
- Attention: one thread block per (sequence, KV head[, row block or partition]) holding up to 16
  query rows (a GQA group, x query tokens for prefill), so K/V bytes are read once per group.
  Its warps split the token range and merge once at the end: no barrier in the main loop. Each
  warp stages 16-token K/V tiles into its own shared memory with `cp.async` (16-byte copies,
  the next tile in flight) and computes on tensor cores (`mma.sync` fp16/bf16 → fp32, fragments
  by `ldmatrix`), or with fp32 FMAs and warp shuffles for fp32 caches (`_simt_attend.py`).
  Softmax in base 2 with explicit -inf masking; no `fastmath`.
- Prefill on tensor cores is FA2 class (issue 22, `_fa2_prefill.py`): 64 query rows per
  block (warps split the rows), K/V tiles of 32 tokens staged once per block with
  double-buffered `cp.async`; its grid comes from the longest chunk (a host value) with row
  tiles in grid.x, so no grid dimension can overflow (`prefill.plan_prefill_launches`).
- Split-K decode (`decode_split`, over a device work list; a warp-parallel reduce,
  `decode_reduce`) chosen by `decode_policy` (issue 43): each kernel judged by its own resident
  blocks (`decode.resident_blocks`: 6 one-pass vs 5 split-K blocks per SM on sm_90); one pass
  when its grid fills half the GPU or no sequence reaches 1024 tokens, else the fewest
  partitions within 85% of the best wave efficiency (FA2/FA3), with a ragged batch cut by a
  common chunk size (FlashInfer), so its longest sequence gets the most partitions. Graph
  buckets keep a split grid sized for their worst case and re-partition each step from the
  host lengths (`DecodeGraphs.prepare(..., host_seq_lens=)`).
- Host path (`_host.py`, `graph.py`): memoised specs, kernels and launch configurations, reused
  scratch, and `DecodeGraphs` to replay decode from CUDA graphs per batch-size bucket. Compiled
  kernels are kept on disk across processes (`_kernel_cache.py`, `$PAGEDKV_KERNEL_CACHE`).
- `_ops.py` picks the machine-level operations: inline PTX on a GPU (`_ops_gpu.py`), Python
  twins with per-warp exchanges under the simulator (`_ops_sim.py`). One kernel source. The
  simulator's `cp.async` lands a copy only at the wait that covers it (NaN until then), and
  the warp-collective asm is `sideeffect` + `convergent`.
- copy_blocks keeps sequential pair semantics by grouping dependent pairs into waves.
"""

from kernels.cuda.block_copy import copy_blocks
from kernels.cuda.decode import paged_attention_decode
from kernels.cuda.prefill import paged_prefill_attention
from kernels.cuda.slot_write import write_slots

__all__ = ["copy_blocks", "paged_attention_decode", "paged_prefill_attention", "write_slots"]
