"""Where CUDA kernels run: real GPU or Numba's simulator, and how arguments get there.

Everything that differs between the simulator and a real device lives here, so the kernel
files contain only kernels and their launch arithmetic:

- which `cuda.jit` options are legal (`lineinfo` makes the simulator's jit raise);
- how a torch tensor becomes a kernel argument (a zero-copy `as_cuda_array` view on a GPU, a
  NumPy view in the simulator) — bf16 crosses as its int16 bit pattern, because the CUDA
  array interface has no bf16 type code;
- which stream a launch goes on (torch's current stream, so kernels order correctly with the
  caller's torch work without a device synchronisation);
- how scratch buffers are allocated (torch's caching allocator when torch owns the data:
  `cuda.device_array` would call cudaMalloc, which synchronises the device).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from numba import config, cuda

from kernels._validate import KernelInputError, dtype_name, is_device_array, is_torch

SIMULATOR: bool = bool(config.ENABLE_CUDASIM)

# Threads per attention thread block. 128 = 4 warps: enough lanes to stage a 16x128 fp16
# tile in two coalesced loads per thread, few enough that several blocks stay resident per SM.
# The simulator runs one OS thread per GPU thread, so it uses 32 (same code, more loop trips).
DEFAULT_NUM_THREADS: int = 32 if SIMULATOR else 128

_VIEW_CACHE_SIZE = 64
_view_cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_stream_cache: dict[int, Any] = {}


def jit_options() -> dict[str, Any]:
    """Options for kernel `cuda.jit`: GPU-only options are dropped under the simulator."""
    if SIMULATOR:
        return {"fastmath": True}
    return {"fastmath": True, "lineinfo": True}


def storage_dtype(x: Any) -> np.dtype:
    """The element type a kernel sees for `x` (bfloat16 is seen as its int16 bits)."""
    name = dtype_name(x)
    if name == "bfloat16":
        return np.dtype(np.int16)
    return np.dtype(name)


def kind_of(x: Any) -> str:
    """'f16', 'bf16' or 'f32': how a kernel converts `x`'s elements to float32."""
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[dtype_name(x)]


def to_kernel_array(x: Any, *, cache_view: bool = False) -> Any:
    """A kernel argument viewing the same memory as `x` (never a copy).

    `cache_view=True` memoises the converted view (keyed by pointer, shape, strides, dtype):
    `as_cuda_array` costs tens of microseconds per call, which matters for the KV caches that
    every launch passes. Only long-lived tensors should be cached — the view keeps its tensor
    alive.
    """
    if is_torch(x):
        import torch

        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        if not x.is_cuda:
            if SIMULATOR:
                return x.detach().numpy()
            raise KernelInputError("the cuda backend needs CUDA tensors, got a CPU tensor")
        if SIMULATOR:
            raise KernelInputError("CUDA tensors cannot be used under NUMBA_ENABLE_CUDASIM")
        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.index)
        if cache_view:
            view = _view_cache.get(key)
            if view is not None:
                _view_cache.move_to_end(key)
                return view
        # sync=False: torch's CAI names its stream and Numba would otherwise block the host
        # on it at every conversion; we launch on that same stream, so order is kept anyway.
        view = cuda.from_cuda_array_interface(x.__cuda_array_interface__, owner=x, sync=False)
        if cache_view:
            _view_cache[key] = view
            if len(_view_cache) > _VIEW_CACHE_SIZE:
                _view_cache.popitem(last=False)
        return view
    if isinstance(x, np.ndarray):
        if SIMULATOR:
            return x
        raise KernelInputError(
            "the cuda backend needs device data (CUDA torch tensors or Numba device arrays), "
            "got a NumPy array"
        )
    if hasattr(x, "__cuda_array_interface__"):
        return x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)
    raise KernelInputError(f"unsupported array type for the cuda backend: {type(x).__name__}")


def to_kernel_index(x: Any, like: Any) -> Any:
    """An index array (tables, lengths, slots) on the device where `like` (the cache) lives.

    Host index arrays are common (the scheduler builds them on the CPU); on a GPU they are
    copied over — asynchronously through torch when torch owns the cache. In the simulator
    everything is host memory already.
    """
    if SIMULATOR or is_device_array(x):
        return to_kernel_array(x)
    host = x.detach().numpy() if is_torch(x) else np.ascontiguousarray(x)
    if is_torch(like):
        import torch

        return to_kernel_array(torch.from_numpy(host).to(like.device, non_blocking=True))
    return cuda.to_device(host)


def stream_for(*arrays: Any) -> Any:
    """The stream to launch on: torch's current stream when torch owns the data, else 0."""
    if SIMULATOR:
        return 0
    for x in arrays:
        if is_torch(x) and x.is_cuda:
            import torch

            handle = int(torch.cuda.current_stream(x.device).cuda_stream)
            stream = _stream_cache.get(handle)
            if stream is None:
                stream = cuda.external_stream(handle)
                _stream_cache[handle] = stream
            return stream
    return 0


def empty_like_kind(like: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """An uninitialised array of `dtype` ('float32', 'float16', 'bfloat16') beside `like`."""
    if is_torch(like):
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if dtype == "bfloat16":
        raise KernelInputError("bfloat16 outputs need torch tensors (NumPy has no bfloat16)")
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=dtype)
    return cuda.device_array(shape, dtype=dtype)


def num_sms() -> int:
    """Streaming multiprocessors of the current device (the simulator pretends to have 1)."""
    if SIMULATOR:
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def max_grid_blocks() -> int:
    """Cap for grid-stride kernels: enough blocks to fill every SM a few times over.

    In the simulator each block is a batch of OS threads, so the cap is 8 there.
    """
    if SIMULATOR:
        return 8
    return num_sms() * 8
