"""Numba CPU backend: `njit(parallel=True)` twins of the CUDA kernels, for hosts without a GPU.

Called by the dispatcher in `kernels/__init__.py` (through `kernels.cpu.api`) with validated
arguments (NumPy arrays or CPU torch tensors). fp16, bf16 and fp32 caches are all supported:
Numba has no 16-bit float arrays, so the kernels read the caches' raw bits and widen to float32
themselves (`_tile.py`). One module per kernel: `attend` (the attention loop over decode
items and prefill tiles, which `decode` and `prefill` run and `step` runs with the step's K/V
writes: a model step's per-layer call, prepared once per step), `decode_split`,
`write_slots`, `copy_blocks`; importing the package has no side effect (compiled kernels are
cached on disk by `_cache.njit_cached`, which invalidates by content instead of deleting files).
"""
