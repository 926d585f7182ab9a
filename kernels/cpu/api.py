"""The CPU backend's four entry points, as the dispatcher calls them, and the per-step
attention object a CPU model step uses instead (`StepAttention`, over a pool's `KvBits`).

Gathered here rather than in `kernels/cpu/__init__.py` so that `kernels.cpu.decode` stays the
module and `kernels.cpu.api.paged_attention_decode` the function: no name means both.
"""

from kernels.cpu.copy_blocks import copy_blocks
from kernels.cpu.decode import paged_attention_decode
from kernels.cpu.prefill import paged_prefill_attention
from kernels.cpu.step import KvBits, StepAttention
from kernels.cpu.write_slots import write_slots

__all__ = [
    "KvBits", "StepAttention", "copy_blocks", "paged_attention_decode", "paged_prefill_attention", "write_slots",
]
