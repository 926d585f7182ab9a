"""The kernels' machine-level operations: GPU intrinsics, or their simulator twins.

One kernel source serves both targets: kernels import these names from here, and which
implementation they get is decided once, at import, by `NUMBA_ENABLE_CUDASIM`
(`_ops_gpu.py` / `_ops_gpu_math.py` on a real build — inline PTX, warp shuffles, tensor cores;
`_ops_sim.py` in Numba's simulator — Python, with a per-warp exchange where the GPU uses
shuffles or tensor cores).
"""

from kernels.cuda._runtime import SIMULATOR

if SIMULATOR:
    from kernels.cuda._ops_sim import (  # noqa: I001
        any_sync, bf16x2_to_f32, bits_f32, cp_async16, cp_async16_fill, cp_async4, cp_async4_fill,
        cp_async8, cp_async8_fill, cp_async_commit, cp_async_wait0, cp_async_wait1, ex2,
        f16x2_to_f32, f32x2_to_bf16x2, f32x2_to_f16x2, ld_f32, ld_f32x4, ld_s32, ld_s64, ld_u32,
        ld_v2, ld_v4, ldmatrix_x4, ldmatrix_x4_trans, lds_u32, lds_v2, lds_v4, mma16816_bf16,
        mma16816_f16, movmatrix, pack_hi, pack_lo, shfl_idx, shfl_xor, smem_addr, st_f32,
        st_f32x4, st_u32, st_v2, st_v4, syncwarp,
    )
else:
    from kernels.cuda._ops_gpu import (  # noqa: I001
        any_sync, cp_async16, cp_async16_fill, cp_async4, cp_async4_fill, cp_async8, cp_async8_fill,
        cp_async_commit, cp_async_wait0, cp_async_wait1, ld_f32, ld_f32x4, ld_s32, ld_s64,
        ld_u32, ld_v2, ld_v4, ldmatrix_x4, ldmatrix_x4_trans, lds_u32, lds_v2, lds_v4,
        smem_addr, st_f32, st_f32x4, st_u32, st_v2, st_v4, syncwarp,
    )
    from kernels.cuda._ops_gpu_math import (
        bf16x2_to_f32, bits_f32, ex2, f16x2_to_f32, f32x2_to_bf16x2, f32x2_to_f16x2,
        mma16816_bf16, mma16816_f16, movmatrix, pack_hi, pack_lo, shfl_idx, shfl_xor,
    )

__all__ = [
    "any_sync",
    "bf16x2_to_f32",
    "bits_f32",
    "cp_async4",
    "cp_async4_fill",
    "cp_async8",
    "cp_async8_fill",
    "cp_async16",
    "cp_async16_fill",
    "cp_async_commit",
    "cp_async_wait0",
    "cp_async_wait1",
    "ex2",
    "f16x2_to_f32",
    "f32x2_to_bf16x2",
    "f32x2_to_f16x2",
    "ld_f32",
    "ld_f32x4",
    "ld_s32",
    "ld_s64",
    "ld_u32",
    "ld_v2",
    "ld_v4",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "lds_u32",
    "lds_v2",
    "lds_v4",
    "mma16816_bf16",
    "mma16816_f16",
    "movmatrix",
    "pack_hi",
    "pack_lo",
    "shfl_idx",
    "shfl_xor",
    "smem_addr",
    "st_f32",
    "st_f32x4",
    "st_u32",
    "st_v2",
    "st_v4",
    "syncwarp",
]
