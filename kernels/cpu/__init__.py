"""Numba CPU backend: `njit(parallel=True)` twins of the CUDA kernels, for hosts without a GPU.

Called by the dispatcher in `kernels/__init__.py` (through `kernels.cpu.api`) with validated
arguments (NumPy arrays or CPU torch tensors). fp16, bf16 and fp32 caches are all supported:
Numba has no 16-bit float arrays, so the kernels read the caches' raw bits and widen to float32
themselves (`_tile.py`). One module per kernel: `decode`, `decode_split`, `prefill`,
`write_slots`, `copy_blocks`, and `step` (a model step's per-layer write + attention in one
call, prepared once per step); importing the package has no side effect (compiled kernels are
cached on disk by `_cache.njit_cached`, which invalidates by content instead of deleting files).
"""
