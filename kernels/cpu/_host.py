"""Host-side, zero-copy conversion between the public array types and what the CPU kernels take.

Numba's CPU target has no float16 or bfloat16 arrays, so caches travel as `uint16` views of
the same memory plus a `kv_kind` code, and the kernels widen each tile to float32 themselves
(`kernels/cpu/_tile.py`). float32 caches are viewed as `uint16` too (the last dimension doubles:
two halves per element, little-endian), so every kernel has exactly one compiled signature —
`parallel=True` compiles cost seconds each, and CI compiles them cold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels._validate import dtype_name, is_torch

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2

_KINDS = {"float32": KIND_F32, "float16": KIND_F16, "bfloat16": KIND_BF16}


def kv_bits(x: Any) -> tuple[np.ndarray, int]:
    """A zero-copy uint16 view of a KV array (fp32: last dim doubled) and its `kv_kind` code."""
    kind = _KINDS[dtype_name(x)]
    if is_torch(x):
        import torch

        return x.detach().view(torch.int16).numpy().view(np.uint16), kind
    return np.asarray(x).view(np.uint16), kind


def index_array(x: Any, dtype: type) -> np.ndarray:
    """A contiguous host NumPy view (copy only when needed) of an index array."""
    arr = x.detach().numpy() if is_torch(x) else np.asarray(x)
    return np.ascontiguousarray(arr, dtype=dtype)


def query_f32(x: Any) -> np.ndarray:
    """Queries as contiguous float32: small next to the cache, so widening on the host is cheap."""
    if is_torch(x):
        return np.ascontiguousarray(x.detach().float().numpy())
    return np.ascontiguousarray(x, dtype=np.float32)


def new_like(query: Any) -> Any:
    """An uninitialised output with the query's shape, dtype and container type."""
    if is_torch(query):
        import torch

        return torch.empty(query.shape, dtype=query.dtype)
    return np.empty(query.shape, dtype=query.dtype)


def f32_target(out: Any) -> np.ndarray | None:
    """A float32 NumPy view the kernel may write `out` through directly, if one exists."""
    if dtype_name(out) != "float32":
        return None
    return out.detach().numpy() if is_torch(out) else out


def store(out: Any, result: np.ndarray) -> None:
    """Copy a float32 result into `out`, narrowing to out's dtype."""
    if is_torch(out):
        import torch

        out.copy_(torch.from_numpy(result))
    else:
        out[...] = result
