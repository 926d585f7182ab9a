"""Numba CPU backend: `njit(parallel=True)` twins of the CUDA kernels, for hosts without a GPU.

Called by the dispatcher in `kernels/__init__.py` with validated arguments (NumPy arrays or CPU
torch tensors). fp16, bf16 and fp32 caches are all supported: Numba has no 16-bit float arrays,
so the kernels read the caches' raw bits and widen to float32 themselves (`_tile.py`).
"""

from kernels.cpu._cache_guard import clear_stale_caches

clear_stale_caches()  # before any kernel module loads its cached machine code

from kernels.cpu.copy_blocks import copy_blocks  # noqa: E402
from kernels.cpu.decode import paged_attention_decode  # noqa: E402
from kernels.cpu.prefill import paged_prefill_attention  # noqa: E402
from kernels.cpu.write_slots import write_slots  # noqa: E402

__all__ = ["copy_blocks", "paged_attention_decode", "paged_prefill_attention", "write_slots"]
