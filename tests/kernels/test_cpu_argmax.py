"""The CPU greedy argmax (`kernels.cpu.argmax`) against torch's `argmax(dim=-1)` on random rows
of lengths around its block size: ties (the first wins), all -inf, NaNs (the first NaN wins, as
in torch), -0.0 against 0.0, the maximum in the tail past the last whole block; and its checks."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelInputError
from kernels.cpu.argmax import BLOCK, argmax_rows


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5, 49152])
def test_argmax_rows_is_torchs(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g) * 5
    x[1] = x[1].round()                      # many ties: the first maximal index
    x[2] = float("-inf")
    x[3, n // 2] = float("nan")              # NaNs: the first one
    x[3, n - 1] = float("nan")
    x[4] = 0.0
    x[4, n - 1] = -0.0
    x[5, n - 1] = 1000.0                     # the maximum in the tail (or the last block)
    x[6, 0] = 1000.0
    x[6, n - 1] = 1000.0                     # tied at both ends: the first
    x[7, -min(n, 3):] = float("inf")
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_checks_its_input() -> None:
    with pytest.raises(KernelInputError, match="no elements"):
        argmax_rows(torch.zeros(2, 0))
    with pytest.raises(KernelInputError, match="float32"):
        argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)
