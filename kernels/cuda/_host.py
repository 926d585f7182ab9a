"""Host path of the CUDA attention kernels: memoised variants, index arrays, scratch, launches.

A decode step calls the attention once per layer, so everything that does not change between
calls is computed once: the kernel variant for a geometry (`spec_for`, memoised), the
compiled kernel (`cuda.jit` with an explicit signature, memoised by the kernel files), the
split-K scratch (`Scratch`, grown on demand, reused). Kernels take raw device addresses and a
few scalars, so no per-call array-interface views are built. What remains per call: reading
shapes, `data_ptr()`s, copying host-side index arrays to the device, and the launch itself.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numba import types

from kernels._validate import KernelInputError, dtype_name, is_device_array, is_torch
from kernels.cuda._runtime import SIMULATOR, check_aligned, device_ptr, kind_of
from kernels.cuda._spec import AttentionSpec

ADDR = types.int64
I32 = types.int32
F32 = types.float32
LOG2E = math.log2(math.e)


def scale_log2(scale: float) -> float:
    """The kernels' softmax runs in base 2: exp(s * scale) = 2^(s * scale * log2 e)."""
    return float(scale) * LOG2E


DECODE_MIN_BLOCKS = 6  # one-pass decode: <= 80 registers (the 88 budget of issue 22)
SPLIT_MIN_BLOCKS = 5  # split-K: <= 96 (at 80 its d128 variants spill 72-116 bytes)


def launch_bounds(spec: AttentionSpec) -> tuple[int, int]:
    """(threads, min resident blocks per SM) for the register allocator. Decode and split-K
    with up to 8 rows at head_dim <= 128 promise 6 and 5 blocks of 128 threads per SM: on the
    production toolchain (nvJitLink 13.5) the decode kernel then takes 80 registers with no
    spill, below issue 22's budget of 88 (a bound of 5 gave it 96, where the standalone ptxas
    gave 91); split-K spills at 80, so it keeps 96. Other variants only promise their thread
    count, so the allocator never exceeds what the launch can hold (bench/kernel_sass.py
    measures both toolchains)."""
    if spec.mode != "prefill" and spec.path == "tc" and spec.row_tiles == 1 and spec.head_dim <= 128:
        return spec.num_threads, DECODE_MIN_BLOCKS if spec.mode == "decode" else SPLIT_MIN_BLOCKS
    return spec.num_threads, 1


def attention_ptrs(query: Any, key_cache: Any, value_cache: Any, out: Any) -> tuple[Any, ...]:
    """(query, key cache, value cache, out) addresses, checked for 16-byte alignment."""
    ptrs = tuple(device_ptr(x) for x in (query, key_cache, value_cache, out))
    for name, ptr in zip(("query", "key_cache", "value_cache", "out"), ptrs, strict=True):
        check_aligned(name, ptr)
    return ptrs


@functools.lru_cache(maxsize=512)
def spec_for(head_dim: int, block_size: int, num_kv_heads: int, group_size: int, q_kind: str,
             kv_kind: str, out_kind: str, mode: str) -> AttentionSpec:
    spec = AttentionSpec(head_dim, block_size, num_kv_heads, group_size, q_kind, kv_kind,
                         out_kind, mode)
    spec.check()
    return spec


def attention_spec(query: Any, key_cache: Any, out_kind: str, mode: str) -> AttentionSpec:
    """The variant for (validated) arguments: `key_cache` [num_blocks, kv_heads, block, dim]."""
    shape = key_cache.shape
    num_kv_heads, block_size, head_dim = int(shape[1]), int(shape[2]), int(shape[3])
    return spec_for(head_dim, block_size, num_kv_heads, int(query.shape[1]) // num_kv_heads,
                    kind_of(query), kind_of(key_cache), out_kind, mode)


def output_for(query: Any, out: Any | None) -> Any:
    """`out`, or a new array shaped and typed like `query` on the same device."""
    if out is not None:
        return out
    from kernels.cuda._runtime import empty_like_kind

    return empty_like_kind(query, tuple(int(d) for d in query.shape), dtype_name(query))


def index_ptr(x: Any, like: Any, keep: list[Any]) -> Any:
    """Device address of an int32 index array; host arrays are copied over first.

    The scheduler builds tables and lengths on the host. With torch on the GPU they go
    through pinned memory (torch's caching host allocator) and an asynchronous copy on the
    current stream; the device copy is appended to `keep` so it outlives the launch call.
    """
    if SIMULATOR or is_device_array(x):
        return device_ptr(x)
    host = x.detach() if is_torch(x) else None
    if is_torch(like):
        import torch

        if host is None:
            host = torch.from_numpy(np.ascontiguousarray(x))
        dev = host.pin_memory().to(like.device, non_blocking=True)
    else:
        from numba import cuda

        dev = cuda.to_device(np.ascontiguousarray(host.numpy() if host is not None else x))
    keep.append(dev)
    return device_ptr(dev)


class Scratch:
    """Float32 scratch memory that grows on demand and is reused across calls.

    One buffer per (device, stream): calls on one stream run in order, so reusing the buffer
    there is safe; another stream gets its own. Under the simulator, NumPy.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Any] = {}

    def get(self, like: Any, num_floats: int) -> Any:
        """At least `num_floats` float32 on `like`'s device (contents undefined)."""
        key = self._key(like)
        buf = self._buffers.get(key)
        if buf is None or int(buf.shape[0]) < num_floats:
            size = max(num_floats, 2 * int(buf.shape[0]) if buf is not None else 0)
            buf = self._buffers[key] = self._alloc(like, size)
        return buf

    @staticmethod
    def _key(like: Any) -> tuple[Any, ...]:
        if SIMULATOR or not is_torch(like) or not like.is_cuda:
            return ("host",)
        import torch

        return (like.device.index, int(torch.cuda.current_stream(like.device).cuda_stream))

    @staticmethod
    def _alloc(like: Any, size: int) -> Any:
        if SIMULATOR:
            return np.empty(size, np.float32)
        if is_torch(like):
            import torch

            return torch.empty(size, dtype=torch.float32, device=like.device)
        from numba import cuda

        return cuda.device_array(size, np.float32)


SCRATCH = Scratch()


def require_cuda_layout(spec: AttentionSpec) -> None:
    """Readable refusal for geometries the cuda kernels cannot address with vector loads."""
    if spec.head_dim % 4:
        raise KernelInputError(f"the cuda backend needs head_dim % 4 == 0, got {spec.head_dim}")
