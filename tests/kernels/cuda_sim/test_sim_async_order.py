"""The simulator sees `cp.async` ordering: a copy lands only at the wait that covers it.

A double-buffered pipeline kernel built for this test streams tiles global → shared with
`cp.async` exactly as the attention kernels do (next tile in flight while the current one is
read, `commit` per tile, `wait_group 1` before reading, `wait_group 0` at the end), and each
lane sums values *another* lane copied. The correct kernel matches the float64 sum; the same
kernel with one wait removed or weakened must fail the check (it reads poison), which proves
the simulator tests would catch such a bug in a real kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32

from kernels.cuda import _ops_sim as ops
from kernels.cuda._ops_sim import sim_ptr

WARP = 32
TILE_FLOATS = 4 * WARP  # one 16-byte copy per lane


def make_pipeline(variant: str):
    """The test kernel; `variant`: 'correct', 'no_wait' (the loop's wait dropped) or
    'wait_before_commit' (the wait placed before the next tile's commit: `wait_group 1` then
    leaves the current tile, the newest committed group, in flight)."""

    @cuda.jit
    def pipeline(src_holder, out, num_tiles):
        buf = cuda.shared.array(2 * TILE_FLOATS, float32)
        lane = cuda.threadIdx.x
        base = ops.smem_addr(buf)
        src = src_holder[0]
        ops.cp_async16(base + 16 * lane, src + 16 * lane)  # prologue: tile 0 → slot 0
        ops.cp_async_commit()
        acc = 0.0
        for i in range(num_tiles):
            nxt = i + 1
            if nxt < num_tiles:  # tile i+1 → the other slot while tile i is read
                ops.cp_async16(base + 16 * (lane + WARP * (nxt % 2)),
                               src + 16 * (TILE_FLOATS // 4 * nxt + lane))
            if variant == "wait_before_commit":
                ops.cp_async_wait1()
                ops.cp_async_commit()
            else:
                ops.cp_async_commit()  # (an empty group after the last tile)
                if variant == "correct":
                    ops.cp_async_wait1()  # tile i landed (tile i+1 may be in flight)
            ops.syncwarp()  # every lane's copies visible before any lane reads the tile
            partner = lane ^ 1  # a word another lane copied
            for j in range(4):
                acc += buf[TILE_FLOATS * (i % 2) + 4 * partner + j]
            ops.syncwarp()  # the slot is read: free for the copy two tiles on
        ops.cp_async_wait0()
        out[lane] = acc

    return pipeline


def _run(variant: str, num_tiles: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(num_tiles)
    src = rng.standard_normal((num_tiles, WARP, 4)).astype(np.float32)
    holder = np.empty(1, dtype=object)
    holder[0] = sim_ptr(src)
    out = np.zeros(WARP, np.float32)
    make_pipeline(variant)[1, WARP](holder, out, num_tiles)
    partner = np.arange(WARP) ^ 1
    expected = src.astype(np.float64)[:, partner, :].sum(axis=(0, 2))
    return out, expected


def test_correct_pipeline_matches_float64() -> None:
    out, expected = _run("correct")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert ops.pending_copies() == 0


def _fails_reference(variant: str) -> bool:
    out, expected = _run(variant)
    return not np.allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_a_missing_wait_fails_in_the_simulator() -> None:
    assert _fails_reference("no_wait")


def test_a_misplaced_wait_fails_in_the_simulator() -> None:
    assert _fails_reference("wait_before_commit")


@pytest.mark.parametrize("tiles", [1, 2])
def test_pipeline_edges(tiles: int) -> None:
    out, expected = _run("correct", tiles)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
