"""Tensors on the wire: raw little-endian bytes in C order, with dtype and shape beside them.

Shared by the servicer (decode requests, encode outputs) and the client (the reverse), so both
ends agree on one encoding. bfloat16 has no NumPy dtype: it travels as its raw 16-bit pattern
and is decoded through torch, which does.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

from pagedkv.v1 import compute_node_pb2 as pb

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("compute_node.wire assumes a little-endian host")


MAX_DIMS = 8


class WireError(ValueError):
    """A tensor message whose dtype, shape and byte length do not agree."""


def decode_tensor(msg: pb.Tensor, name: str) -> torch.Tensor:
    """A CPU torch tensor over (a copy of) the message's bytes; `WireError` when malformed.

    The element count is computed in Python integers and checked against the byte length
    before anything is allocated: in int64 (`np.prod`) a shape like `[65536] * 4` wraps to 0
    and `[4, 5, 5581, 8681, 49477, 384773]` to 4, which made a forged shape look consistent.
    """
    dtype = WIRE_DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{name}.dtype must be one of {sorted(WIRE_DTYPES)}, got {msg.dtype!r}")
    if len(msg.shape) > MAX_DIMS:
        raise WireError(f"{name} has {len(msg.shape)} dimensions; at most {MAX_DIMS} are accepted")
    shape = tuple(int(d) for d in msg.shape)
    numel = math.prod(shape)
    expected = numel * dtype.itemsize
    if len(msg.data) != expected:
        raise WireError(
            f"{name} has {len(msg.data)} bytes, but shape {list(shape)} of {msg.dtype} needs {expected}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer wants a writable buffer and the protobuf bytes are not.
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def encode_tensor(x: Any) -> pb.Tensor:
    """A Tensor message from a NumPy array (float16/float32) or a CPU/CUDA torch tensor."""
    if isinstance(x, torch.Tensor):
        name = str(x.dtype).removeprefix("torch.")
        if name not in WIRE_DTYPES:
            raise WireError(f"cannot send torch dtype {x.dtype}")
        t = x.detach().contiguous().cpu()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        return pb.Tensor(dtype=name, shape=list(t.shape), data=raw)
    arr = np.asarray(x)
    name = arr.dtype.name
    if name not in ("float16", "float32"):
        raise WireError(f"cannot send numpy dtype {arr.dtype} (use float16/float32, or a torch tensor for bfloat16)")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return pb.Tensor(dtype=name, shape=list(arr.shape), data=arr.tobytes())


def tensor_to_numpy(msg: pb.Tensor, name: str = "tensor") -> np.ndarray:
    """A NumPy array of the message (bfloat16 widened to float32, exactly)."""
    t = decode_tensor(msg, name)
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()
