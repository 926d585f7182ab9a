"""Element conversions between storage types and float32, as CUDA device functions.

Kernels compute in float32 whatever the storage type. Three storage kinds:

- 'f32' and 'f16' convert with plain casts;
- 'bf16' arrives as int16 (its bit pattern: torch bf16 does not cross the CUDA array
  interface as bf16), so loading shifts the 16 bits into the high half of a float32 and
  storing rounds float32 to the nearest-even bf16 bit pattern. On a GPU the bit casts are
  libdevice intrinsics; the simulator has no libdevice, so it gets NumPy equivalents.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, int16, int32, types
from numba.types import float16

from kernels.cuda._runtime import SIMULATOR

NUMBA_STORAGE = {"f16": types.float16, "bf16": types.int16, "f32": types.float32}

if SIMULATOR:

    def _int_as_float(bits: Any) -> Any:
        return np.array([int(bits) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def _float_as_int(value: Any) -> Any:
        return int(np.array([value], dtype=np.float32).view(np.int32)[0])

    int_as_float = cuda.jit(device=True)(_int_as_float)
    float_as_int = cuda.jit(device=True)(_float_as_int)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def int_as_float(bits: Any) -> Any:
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, inline=True)
    def float_as_int(value: Any) -> Any:
        return libdevice.float_as_int(float32(value))


@cuda.jit(device=True, inline=True)
def _load_f32(x: Any) -> Any:
    return float32(x)


@cuda.jit(device=True, inline=True)
def _load_bf16(x: Any) -> Any:
    # bf16 is the high half of a float32: widen the (sign-extended) int16 bits back.
    return int_as_float((int32(x) & int32(0xFFFF)) << int32(16))


@cuda.jit(device=True, inline=True)
def _store_f32(v: Any) -> Any:
    return float32(v)


@cuda.jit(device=True, inline=True)
def _store_f16(v: Any) -> Any:
    return float16(v)


@cuda.jit(device=True, inline=True)
def _store_bf16(v: Any) -> Any:
    if v != v:
        return int16(0x7FC0)  # canonical quiet NaN; rounding below would turn NaN into inf
    bits = float_as_int(v)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop 16 bits.
    rounded = bits + int32(0x7FFF) + ((bits >> int32(16)) & int32(1))
    return int16(rounded >> int32(16))


@cache
def loader(kind: str) -> Any:
    """Device function storage element → float32 for a storage kind."""
    return _load_bf16 if kind == "bf16" else _load_f32


@cache
def storer(kind: str) -> Any:
    """Device function float32 → storage element for a storage kind."""
    return {"f32": _store_f32, "f16": _store_f16, "bf16": _store_bf16}[kind]
