"""CPU float32 GEMM for a model's dense layers, `x @ weight.T + bias`, on weights packed once
into 16-column panels: the decode-sized case (a few to a few dozen rows against every weight)
at the rate oneDNN reaches only for prefill-sized inputs.

oneDNN's float32 matmul on an AVX2 CPU (the project's 2-vCPU AMD EPYC host, 2026-12-07) runs
a decode step's matmuls of 16-32 rows at ~60% of the FMA peak and prefill-sized ones at ~100%:
its small-M path re-blocks the problem for each call. Here the weight `[out, in]` is laid out
once as `[out / 16, in, 16]` panels (`pack`: each panel is 16 output columns, contiguous over
K), and each thread takes a contiguous half of the panels, streaming every weight byte from
memory once per step while the inputs sit in cache: per panel, the rows go through the
6 x 16 register tile of `_gemm_tile` (the last rows of a ragged M through a smaller one), so
each weight vector loaded feeds up to 12 FMAs. Prefill-sized M is cut into row blocks (the
input block stays in L2 while every panel passes) and long K into column blocks (a block's
partial sums are re-loaded from the output: `zero_init` off).

The sums are float32 FMAs in K order per output element (no pairwise or blocked reduction
beyond the K blocks): results differ from `F.linear` by float rounding, like oneDNN's.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from numba import prange

from kernels._validate import KernelInputError
from kernels.cpu._cache import njit_cached
from kernels.cpu._gemm_tile import MAX_TILE_ROWS, PANEL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6

# Rows per block of the input: the block stays in a core's L2 while every panel of the thread's
# share passes (`_blocks`). Decode-sized M is one block.
ROW_BLOCK = 96
# Input bytes per block (rows x K-block x 4) that the K blocking keeps under: half a 1 MiB L2.
BLOCK_BYTES = 1 << 19
# While a panel is multiplied, the tile prefetches the same K rows of the panel this many panels
# further on (one 64-byte line per K step): the first tile of each panel would otherwise wait on
# memory for its weights. Only where a panel takes more than one tile: with one (up to 6 rows)
# each panel is read once, in order, which the hardware prefetcher streams by itself, and the
# extra loads cost (two threads, 30 layers of the 135M shape, 2026-12-07: 1 row 16.1 ms without,
# 18.0 with; 16 rows 41.5 without, 37.2 with). 0 prefetches the current panel (a no-op).
PREFETCH_AHEAD = 1
_NO_BIAS: Any = np.zeros((1, 0), np.float32)


@njit_cached(inline="always")
def _tile(rows, a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off):
    # A literal row count per call site: each tile intrinsic is compiled for its row count.
    if rows == 6:
        tile_6(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off)
    elif rows == 5:
        tile_5(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off)
    elif rows == 4:
        tile_4(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off)
    elif rows == 3:
        tile_3(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off)
    elif rows == 2:
        tile_2(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off)
    else:
        tile_1(a, a_off, lda, b, b_off, k_len, c, c_off, ldc, src, src_off, src_stride, zero_init, prefetch_off)


@njit_cached(inline="always")
def tile_rows(left):
    # 7-11 rows left: two tiles of about half (8 = 4 + 4, not 6 + 2: a 1-2 row tile has too few
    # accumulators to hide the FMA latency); more than 11: a full tile.
    if left <= MAX_TILE_ROWS:
        return left
    if left < 2 * MAX_TILE_ROWS:
        return (left + 1) // 2
    return MAX_TILE_ROWS


@njit_cached(inline="always")
def gemm_share(a, panels, bias, out, first, stop, row_block, k_block, prefetch_ahead):
    # Panels [first, stop) of `out = a @ weight.T + bias`: one thread's share, which the fused
    # layer kernels (`fused_layer.py`) call inside their own parallel loops.
    # a: [m, k] float32; panels: [p, k, 16]; bias: [1, p * 16] or [1, 0]; out: [m, p * 16].
    # Prefetches past the last panel are harmless (a prefetch never faults).
    m, k = a.shape
    n = panels.shape[0] * PANEL
    has_bias = bias.shape[1] != 0
    for m0 in range(0, m, row_block):
        m1 = min(m, m0 + row_block)
        for k0 in range(0, k, k_block):
            k_len = min(k_block, k - k0)
            for p in range(first, stop):
                col = p * PANEL
                b_off = p * k * PANEL + k0 * PANEL
                prefetch_off = prefetch_ahead * k * PANEL
                r = m0
                while r < m1:
                    rows = tile_rows(m1 - r)
                    c_off = r * n + col
                    if k0 > 0:      # a later K block: add to the partial sums in `out`
                        src, src_off, src_stride, zero_init = out, c_off, n, False
                    elif has_bias:  # the first: start from the bias (the same row for every row)
                        src, src_off, src_stride, zero_init = bias, col, 0, False
                    else:
                        src, src_off, src_stride, zero_init = out, c_off, n, True
                    _tile(rows, a, r * k + k0, k, panels, b_off, k_len, out, c_off, n,
                          src, src_off, src_stride, zero_init, prefetch_off)
                    r += rows


@njit_cached(parallel=True)
def _gemm(a, panels, bias, out, num_chunks, row_block, k_block, prefetch_ahead):
    num_panels = panels.shape[0]
    for chunk in prange(num_chunks):
        gemm_share(a, panels, bias, out, chunk * num_panels // num_chunks, (chunk + 1) * num_panels // num_chunks,
                   row_block, k_block, prefetch_ahead)

def pack(weight: torch.Tensor) -> torch.Tensor:
    """float32 `weight` `[out_features, in_features]` as panels `[ceil(out / 16), in, 16]`:
    panel p holds output columns 16p..16p+15, row k their weights for input k (zeros past
    `out_features`). A copy; the GEMM reads only this layout."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise KernelInputError(f"weight must be 2-D float32, got {weight.dim()}-D {weight.dtype}")
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    if out_features % PANEL:   # (a model's widths are whole panels: no padded copy for those)
        weight = torch.cat([weight, weight.new_zeros(num_panels * PANEL - out_features, in_features)])
    return weight.reshape(num_panels, PANEL, in_features).transpose(1, 2).contiguous()


def blocks(rows: int, in_features: int) -> tuple[int, int]:
    """(row block, K block): blocks of about equal size, rows a multiple of the tile height."""
    row_blocks = -(-rows // ROW_BLOCK)
    row_block = -(-rows // row_blocks)
    row_block += -row_block % MAX_TILE_ROWS if row_blocks > 1 else 0
    k_blocks = -(-(row_block * in_features * 4) // BLOCK_BYTES)
    return row_block, -(-in_features // k_blocks)


def prefetch_ahead(rows: int) -> int:
    """The prefetch distance for `rows` input rows (`PREFETCH_AHEAD`: only past one tile)."""
    return PREFETCH_AHEAD if rows > MAX_TILE_ROWS else 0


def gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
         out_features: int | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for float32 CPU `x` `[..., in_features]` and `panels = pack(weight)`;
    `out_features` defaults to the panels' width (`16 * panels.shape[0]`). Runs on Numba's
    threads (one contiguous share of the panels each)."""
    if x.dtype != torch.float32 or panels.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelInputError(f"gemm takes float32 CPU tensors, got x {x.dtype} on {x.device}, panels {panels.dtype}")
    if panels.dim() != 3 or not panels.is_contiguous():
        raise KernelInputError(f"panels must be pack()'s contiguous [p, in, 16], got shape {tuple(panels.shape)}")
    num_panels, in_features, width = panels.shape
    width_out = num_panels * PANEL
    n = width_out if out_features is None else out_features
    if width != PANEL or x.shape[-1] != in_features or not width_out - PANEL < n <= width_out:
        raise KernelInputError(f"x {tuple(x.shape)} does not match panels {tuple(panels.shape)} "
                               f"for {n} output features")
    lead = x.shape[:-1]
    a = x.detach().reshape(-1, in_features).contiguous()
    out = torch.empty(a.shape[0], width_out, dtype=torch.float32)
    if bias is None:
        bias_row = _NO_BIAS
    else:
        if bias.shape != (n,):
            raise KernelInputError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        bias_row = bias.detach().float().reshape(1, n).numpy()
        if n != width_out:
            bias_row = np.pad(bias_row, ((0, 0), (0, width_out - n)))
    if a.shape[0]:
        row_block, k_block = blocks(a.shape[0], in_features)
        _gemm(a.numpy(), panels.numpy(), np.ascontiguousarray(bias_row), out.numpy(),
              numba.get_num_threads(), row_block, k_block, prefetch_ahead(a.shape[0]))
    if n != width_out:
        out = out[:, :n].contiguous()
    return out.view(*lead, n)

