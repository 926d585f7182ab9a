"""Numba CUDA backend of the paged-KV kernels.

The public dispatcher (`kernels/__init__.py`) validates and normalises arguments, then calls
these four functions with the public parameters minus `backend`. Data must live on the GPU
(CUDA torch tensors or Numba device arrays; host index arrays are copied over); under
`NUMBA_ENABLE_CUDASIM=1` NumPy arrays and CPU torch tensors run in Numba's simulator.
bf16 tensors are passed as their int16 bit pattern and converted in-kernel.
"""

from kernels.cuda.block_copy import copy_blocks
from kernels.cuda.decode import paged_attention_decode
from kernels.cuda.prefill import paged_prefill_attention
from kernels.cuda.slot_write import write_slots

__all__ = ["copy_blocks", "paged_attention_decode", "paged_prefill_attention", "write_slots"]
