"""The simulator twins of the kernels' machine operations follow the PTX ISA.

The kernels run in the simulator through `_ops_sim.py`; on a GPU the same source runs inline
PTX (`_ops_gpu.py`). These tests pin the twins to the documented semantics, written out here
independently of the kernels: the fragment layouts of `mma.m16n8k16` (groupID =
lane >> 2, threadID_in_group = lane % 4; A rows g / g+8, columns 2t+(0,1) / +8; B rows 2t+(0,1)
/ +8, column g; C rows g / g+8, columns 2t+(0,1)), `ldmatrix` (lanes 8i..8i+7 address matrix
i's rows; lane (g, t) receives row g, columns 2t, 2t+1 — or, transposed, rows 2t, 2t+1 of
column g), `movmatrix.trans`, `prmt`, `cvt.rn` packing (the first operand in the high half),
`cp.async` with a source size (zero fill), and the bounds/alignment checks of `SimPtr`.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kernels.cuda import _ops_sim as ops
from kernels.cuda._ops_sim import SimPtr, sim_ptr


def _f16_words(matrix: np.ndarray, rows: list[int], col: int) -> int:
    pair = matrix[rows[0], col:col + 2] if len(rows) == 1 else matrix[rows, col]
    return int(np.asarray(pair, np.float16).view(np.uint16)[0]) | (
        int(np.asarray(pair, np.float16).view(np.uint16)[1]) << 16)


def _a_frags(a: np.ndarray, lane: int, k: int) -> list[int]:
    g, t = divmod(lane, 4)
    regs = [(g, 2 * t), (g + 8, 2 * t)]
    if k == 16:
        regs += [(g, 2 * t + 8), (g + 8, 2 * t + 8)]
    return [_f16_words(a, [r], c) for r, c in regs]


def _b_frags(b: np.ndarray, lane: int, k: int) -> list[int]:
    g, t = divmod(lane, 4)
    rows = [2 * t] + ([2 * t + 8] if k == 16 else [])
    return [_f16_words(b, [r, r + 1], g) for r in rows]


@pytest.mark.parametrize("k", [16])
def test_mma_matches_documented_fragments(k: int) -> None:
    rng = np.random.default_rng(k)
    a = rng.standard_normal((16, k)).astype(np.float16)
    b = rng.standard_normal((k, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    frags = np.array([_a_frags(a, lane, k) + _b_frags(b, lane, k) for lane in range(32)],
                     dtype=np.uint32)
    acc = np.array([[c[(lane >> 2) + 8 * (i // 2), 2 * (lane & 3) + i % 2] for i in range(4)]
                    for lane in range(32)], dtype=np.float32)
    out = np.zeros((32, 4), np.float32)

    @cuda.jit
    def kernel(frags, acc, out):
        lane = cuda.threadIdx.x
        f = frags[lane]
        d = ops.mma16816_f16(f[0], f[1], f[2], f[3], f[4], f[5], acc[lane, 0], acc[lane, 1],
                             acc[lane, 2], acc[lane, 3])
        for i in range(4):
            out[lane, i] = d[i]

    kernel[1, 32](frags, acc, out)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            assert out[lane, i] == pytest.approx(want[g + 8 * (i // 2), 2 * t + i % 2], rel=1e-5)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_and_movmatrix(trans: bool) -> None:
    rng = np.random.default_rng(1)
    mats = rng.integers(0, 2**16, size=(4, 8, 8), dtype=np.uint16)  # four 8x8 b16 matrices
    smem = np.zeros((4, 8, 16), np.uint16)  # rows padded to 32 bytes: non-contiguous rows
    smem[:, :, :8] = mats
    base = sim_ptr(smem)
    out = np.zeros((32, 5), np.uint32)

    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        row = base + (lane // 8) * 256 + (lane % 8) * 32  # lane 8i+r → matrix i, row r
        regs = ops.ldmatrix_x4_trans(row) if trans else ops.ldmatrix_x4(row)
        for i in range(4):
            out[lane, i] = regs[i]
        out[lane, 4] = ops.movmatrix(regs[0])

    kernel[1, 32](out)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            m = mats[i].T if trans else mats[i]
            assert out[lane, i] == int(m[g, 2 * t]) | (int(m[g, 2 * t + 1]) << 16)
        m0 = mats[0] if trans else mats[0].T  # movmatrix transposes matrix 0 once more
        assert out[lane, 4] == int(m0[g, 2 * t]) | (int(m0[g, 2 * t + 1]) << 16)


def test_an_out_of_bounds_ldmatrix_row_fails_the_launch_at_once() -> None:
    """One lane's bad address: the warp-wide load raises it in every lane (each would have
    read all 32 rows), not a deadlock of the other 31 at their next collective."""
    smem = np.zeros((32, 8), np.uint16)
    base = sim_ptr(smem)
    reached = np.zeros(32, np.int64)

    @cuda.jit
    def kernel(reached):
        lane = cuda.threadIdx.x
        ops.ldmatrix_x4(base + lane * 16 + (16 if lane == 31 else 0))   # lane 31: one row past the end
        reached[lane] = 1

    with pytest.raises(IndexError):
        kernel[1, 32](reached)
    assert not reached.any()


def test_shuffles() -> None:
    out = np.zeros((32, 2), np.int64)

    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        out[lane, 0] = ops.shfl_xor(lane * 10, 5)
        out[lane, 1] = ops.shfl_idx(lane * 10, (lane * 7) % 32)

    kernel[1, 32](out)
    assert out[:, 0].tolist() == [(lane ^ 5) * 10 for lane in range(32)]
    assert out[:, 1].tolist() == [((lane * 7) % 32) * 10 for lane in range(32)]


def test_packing_rounds_to_nearest_even_first_operand_high() -> None:
    lo, hi = np.float32(1.0009765625 + 2**-12), np.float32(-3.5)  # lo halfway → rounds to even
    word = ops.f32x2_to_f16x2(lo, hi)
    halves = np.array([word & 0xFFFF, word >> 16], np.uint16).view(np.float16)
    assert halves[0] == np.float16(lo) and halves[1] == np.float16(hi)
    assert ops.f16x2_to_f32(word) == (np.float32(halves[0]), np.float32(halves[1]))
    bf = ops.f32x2_to_bf16x2(np.float32(1.0 + 2**-8), np.float32(np.nan))  # tie → even (1.0)
    assert bf & 0xFFFF == 0x3F80 and (bf >> 16) & 0x7FC0 == 0x7FC0
    assert ops.pack_lo(0x11112222, 0x33334444) == 0x44442222
    assert ops.pack_hi(0x11112222, 0x33334444) == 0x33331111


def test_cp_async_zero_fill_and_simptr_checks() -> None:
    src = np.arange(8, dtype=np.float32)
    dst = np.full(8, -1.0, np.float32)
    ops.cp_async16_fill(sim_ptr(dst), sim_ptr(src), 16)
    ops.cp_async16_fill(sim_ptr(dst) + 16, sim_ptr(src) + 16, 0)  # past the range: zeros
    assert np.isnan(dst).all()  # in flight: the destination reads back poison
    ops.cp_async_commit()
    ops.cp_async_wait0()
    assert dst.tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
    assert ops.pending_copies() == 0
    with pytest.raises(RuntimeError, match="misaligned"):
        ops.ld_v4(sim_ptr(src) + 4)
    with pytest.raises(IndexError):
        ops.ld_v4(SimPtr(src.view(np.uint8), 32))
