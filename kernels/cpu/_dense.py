"""What the CPU dense-layer kernels (`rms_norm`, `rope`) share: checked float32 NumPy views
of their arguments, cheaply.

These ops replace a few torch calls of a few µs each, so their own overhead is the point: the
general validators of `kernels._validate` cost ~6 µs per array (four arrays: more than the
decode-sized op itself), so a float32 C-contiguous CPU tensor or NumPy array — what the model
passes — is checked with a few attribute reads (`f32_view`, which `step.StepAttention` uses
too); anything else takes the general path. They run on the calling thread: measured, a
parallel loop was no faster at prefill sizes (a 1216 x 576 norm: 272 µs on one core, 280 on
two: memory-bound) and costs a wake-up of the other threads at decode sizes (`_parallel.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernels import _validate
from kernels._validate import KernelInputError


def f32_view(x: Any) -> np.ndarray | None:
    """`x` as a float32 NumPy view when it is a C-contiguous float32 host array or CPU tensor
    (a few attribute reads), else None: the caller then checks it the general way."""
    if type(x) is torch.Tensor:
        if x.dtype is torch.float32 and x.device.type == "cpu" and x.is_contiguous() and not x.requires_grad:
            return x.numpy()
    elif type(x) is np.ndarray and x.dtype == np.float32 and x.flags.c_contiguous:
        return x
    return None


def rows_f32(name: str, x: Any, ndim: int = 2) -> np.ndarray:
    """A float32, C-contiguous, host `x` of `ndim` dims as a NumPy view (no copy)."""
    view = f32_view(x)
    if view is not None and view.ndim == ndim:
        return view
    if _validate.is_device_array(x):
        raise KernelInputError(f"{name} must be a host array, got a device one")
    if getattr(x, "ndim", None) != ndim:
        raise KernelInputError(f"{name} must have {ndim} dims, got shape {tuple(getattr(x, 'shape', ()))}")
    if _validate.dtype_name(x) != "float32":
        raise KernelInputError(f"{name} must be float32, got {_validate.dtype_name(x)}")
    if not _validate.is_contiguous(x):
        raise KernelInputError(f"{name} must be C-contiguous")
    return x.detach().numpy() if _validate.is_torch(x) else np.asarray(x)


def check_rows(name: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise KernelInputError(f"{name} must have shape {shape}, got {x.shape}")
