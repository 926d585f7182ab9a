"""The panel GEMM (`kernels.cpu.gemm`) against a float64 reference on random inputs: ragged row
counts (not a multiple of the 6-row tile, across a row-block boundary), output widths that are
not a multiple of the 16-column panel, long K (several K blocks, partial sums re-loaded), bias,
strided and 3-D inputs, one and two threads; the packed layout itself; and the input checks."""

from __future__ import annotations

import numba
import pytest
import torch

from kernels import KernelInputError
from kernels.cpu import gemm as G


def _case(seed: int, rows: int, in_features: int, out_features: int, with_bias: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    bias = torch.randn(out_features, generator=g) if with_bias else None
    return torch.randn(rows, in_features, generator=g), weight, bias


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = x.double() @ weight.double().T + (0.0 if bias is None else bias.double())
    # float32 sums of in_features products: error grows with the sum of the products' sizes
    scale = x.double().abs() @ weight.double().abs().T + (0.0 if bias is None else bias.double().abs())
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() / scale.clamp_min(1e-3)).max() <= 2e-6


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 5, 16),        # one row, one panel, K shorter than a vector
    (7, 13, 37),       # 7 rows = 4 + 3 tiles; two full panels and a 5-column one
    (16, 576, 960),    # a decode step's q/k/v
    (37, 1536, 576),   # down projection; 37 = 6 * 5 + 4 + 3
    (97, 64, 100),     # two row blocks (ROW_BLOCK 96)
    (96, 5000, 48),    # four K blocks: the later ones add to the partial sums in the output
    (200, 1500, 129),  # row blocks of 72 (a multiple of the tile), a 1-column last panel
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64(rows: int, in_features: int, out_features: int, with_bias: bool) -> None:
    x, weight, bias = _case(rows * 7 + in_features, rows, in_features, out_features, with_bias)
    got = G.gemm(x, G.pack(weight), bias, out_features)
    _check(got, x, weight, bias)


def test_blocks_are_what_the_cases_above_exercise() -> None:
    assert G.blocks(37, 1536) == (37, 1536)      # decode-sized: one block of each
    assert G.blocks(97, 64)[0] == 54             # two row blocks, a multiple of the tile
    row_block, k_block = G.blocks(96, 5000)
    assert row_block == 96 and k_block == 1250    # four K blocks
    assert G.blocks(200, 1500) == (72, 1500)


@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_on_one_or_two_threads(threads: int) -> None:
    """Each thread takes a contiguous share of the panels; with fewer panels than threads a
    share is empty."""
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for out_features in (16, 80):   # one panel; five (shares of 2 and 3)
            x, weight, bias = _case(out_features, 9, 40, out_features, True)
            _check(G.gemm(x, G.pack(weight), bias), x, weight, bias)
    finally:
        numba.set_num_threads(previous)


def test_gemm_takes_strided_3d_and_empty_inputs() -> None:
    x, weight, _ = _case(3, 2 * 5 * 2, 2 * 24, 48, False)
    strided = x.view(2, 5, 2, 48)[:, :, 0, ::2]   # [2, 5, 24], neither dim contiguous
    got = G.gemm(strided, G.pack(weight[:, :24].contiguous()))
    assert got.shape == (2, 5, 48)
    _check(got.reshape(10, 48), strided.reshape(10, 24), weight[:, :24], None)
    assert G.gemm(torch.empty(0, 24), G.pack(weight[:, :24].contiguous())).shape == (0, 48)


def test_pack_layout() -> None:
    """Panel p, row k holds columns 16p..16p+15 of input k; past out_features, zeros."""
    weight = torch.arange(37 * 3, dtype=torch.float32).view(37, 3)
    panels = G.pack(weight)
    assert panels.shape == (3, 3, 16) and panels.is_contiguous()
    for p in range(3):
        for k in range(3):
            for j in range(16):
                column = 16 * p + j
                assert panels[p, k, j] == (weight[column, k] if column < 37 else 0.0)


def test_bad_inputs_raise_typed_errors() -> None:
    x, weight, _ = _case(1, 4, 8, 32, False)
    panels = G.pack(weight)
    with pytest.raises(KernelInputError, match="float32"):
        G.pack(weight.double())
    with pytest.raises(KernelInputError, match="float32"):
        G.gemm(x.double(), panels)
    with pytest.raises(KernelInputError, match="does not match"):
        G.gemm(torch.randn(4, 9), panels)                 # in_features
    with pytest.raises(KernelInputError, match="does not match"):
        G.gemm(x, panels, out_features=16)               # a whole panel too many
    with pytest.raises(KernelInputError, match="panels must be"):
        G.gemm(x, panels.transpose(0, 1))
    with pytest.raises(KernelInputError, match="bias"):
        G.gemm(x, panels, torch.zeros(31))
