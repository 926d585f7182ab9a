"""Where CUDA kernels run: real GPU or Numba's simulator, and how arguments get there.

Everything that differs between the simulator and a real device lives here (and in
`_ops.py`), so the kernel files contain only kernels and their launch arithmetic:

- which `cuda.jit` options are legal (`lineinfo`, `launch_bounds`, `forceinline` make the
  simulator's jit raise);
- how an array becomes a kernel argument: kernels take raw device addresses (`device_ptr`:
  `data_ptr()` of a CUDA torch tensor, never a copy, and no per-call array-interface view);
  under the simulator a `SimPtr` over the host array's bytes;
- which stream a launch goes on (torch's current stream, so kernels order correctly with the
  caller's torch work without a device synchronisation), and the memoised launch
  configurations;
- how output buffers are allocated (torch's caching allocator when torch owns the data:
  `cuda.device_array` would call cudaMalloc, which synchronises the device).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import config, cuda

from kernels._validate import KernelInputError, dtype_name, is_torch

SIMULATOR: bool = bool(config.ENABLE_CUDASIM)

_stream_cache: dict[int, Any] = {}
_launch_cache: dict[tuple[Any, ...], Any] = {}
_LAUNCH_CACHE_SIZE = 1024


def jit_options(launch_bounds: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Options for kernel `cuda.jit`: GPU-only options are dropped under the simulator.

    No `fastmath`: in Numba it means LLVM `fast` (no NaN, no infinity) plus approximate
    division, and the softmax relies on -inf (masked tokens, empty rows). The few places that
    want an approximation say so explicitly (`ex2.approx` in `_ops_gpu.py`).
    `launch_bounds` (threads per block, min resident blocks per SM) goes into the PTX, so
    ptxas fits the registers to what the launch needs.

    No link-time optimisation (`lto=False`; numba-cuda turns it on whenever nvJitLink is
    installed): the kernels are self-contained (every device function is inlined by NVVM),
    so LTO has nothing to optimise across, yet it costs a second NVVM pass per variant
    (~1-1.5 s of each ~5-7 s JIT, issue 43) and builds other machine code than the static gate
    measures — for sm_90a the one-pass decode kernel gets 8 bytes of spill through LTO-IR,
    none through PTX (both 80 registers; split-K 93 vs 95). Through PTX, production links
    exactly what `bench/kernel_sass.py` gates.
    """
    if SIMULATOR:
        return {}
    options: dict[str, Any] = {"lineinfo": True, "lto": False}
    if launch_bounds:
        options["launch_bounds"] = launch_bounds
    return options


def device_function(fn: Any) -> Any:
    """`cuda.jit(device=True)`, inlined by NVVM on a GPU build (`forceinline`).

    Every device function of the kernels is small and called from a hot loop: inlined, its
    per-lane local arrays become registers. NVVM-level inlining compiles each function once;
    Numba's IR-level `inline="always"` re-types it at every call site (tens of seconds per
    variant instead of about two).
    """
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def kind_of(x: Any) -> str:
    """'f16', 'bf16' or 'f32': how a kernel converts `x`'s elements to float32."""
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[dtype_name(x)]


def device_ptr(x: Any) -> Any:
    """The address of `x`'s first element as a kernel argument (never a copy).

    A CUDA torch tensor or Numba device array gives its device address (an int); under the
    simulator, NumPy arrays and CPU torch tensors give a `SimPtr` over their bytes.
    """
    if SIMULATOR:
        from kernels.cuda._ops_sim import sim_ptr

        if is_torch(x):
            if x.is_cuda:
                raise KernelInputError("CUDA tensors cannot be used under NUMBA_ENABLE_CUDASIM")
            import torch

            x = x.detach()
            if x.dtype == torch.bfloat16:
                x = x.view(torch.int16)
            return sim_ptr(x.numpy())
        return sim_ptr(np.asarray(x))
    if is_torch(x):
        if not x.is_cuda:
            raise KernelInputError("the cuda backend needs CUDA tensors, got a CPU tensor")
        return int(x.data_ptr())
    if isinstance(x, np.ndarray):
        raise KernelInputError(
            "the cuda backend needs device data (CUDA torch tensors or Numba device arrays), "
            "got a NumPy array"
        )
    if hasattr(x, "__cuda_array_interface__"):
        return int(x.__cuda_array_interface__["data"][0])
    raise KernelInputError(f"unsupported array type for the cuda backend: {type(x).__name__}")


def check_aligned(name: str, ptr: Any, align: int = 16) -> None:
    """Vector loads and stores need aligned addresses: a view with an odd offset would fault."""
    offset = ptr.offset if SIMULATOR else ptr
    if offset % align:
        raise KernelInputError(f"{name} must start at a {align}-byte aligned address")


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


def launcher(kernel: Any, grid: tuple[int, ...] | int, threads: int, stream: Any) -> Any:
    """`kernel[grid, threads, stream]`, memoised: building a launch configuration checks the
    grid and may warn, which costs more per call than the launch itself.

    Not under the simulator: there `kernel[...]` sets the grid on the kernel object and returns
    that same object, so a memoised configuration would launch with whatever grid the last
    configuration of that kernel set (a decode of 3 sequences after a graph bucket of 4 read
    past its lengths)."""
    if SIMULATOR:
        return kernel[grid, threads, stream]
    key = (id(kernel), grid, threads, id(stream))
    config_ = _launch_cache.get(key)
    if config_ is None:
        if len(_launch_cache) >= _LAUNCH_CACHE_SIZE:
            _launch_cache.clear()
        config_ = _launch_cache[key] = kernel[grid, threads, stream]
    return config_


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
