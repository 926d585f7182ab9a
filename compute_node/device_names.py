"""The device names a node accepts, checked without importing torch.

`auto`, `cpu`, `cuda`, `cuda:N`: the same rule for `compute-node serve --device`, `LLM(device=)`
and `pagedkv-serve --device`, so a misspelt device is said before any weights load, in the same
words everywhere. Whether CUDA is actually there is torch's to say, later (`pool.resolve_device`).
"""

from __future__ import annotations

import re

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device_name_problem(device: object) -> str | None:
    """What is wrong with the spelling of `device` (said after "device: "); None when it is one
    of the accepted names."""
    if isinstance(device, str) and _DEVICE.match(device):
        return None
    return f"expected auto, cpu, cuda or cuda:N, got {device!r}"
