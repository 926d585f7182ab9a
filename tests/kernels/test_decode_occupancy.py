"""The split policy against the occupancy of the kernels as they are built (no GPU).

The benchmark variant's one-pass and split-K kernels are built the production way for sm_90
(PTX, then nvJitLink: `bench/kernel_sass.py`); their registers and shared memory give the
blocks per SM each holds. Those figures, times an H100/H200's 132 SMs, go through
`decode.resident_blocks` — each kernel reporting its own — and the policy must then never
overfill the split kernel: the bug of issue 43 was the split grid sized by the one-pass
kernel's 6 blocks per SM while the split kernel holds 5. When a kernel's registers change,
the figures here follow (test_decode_policy.py pins the H200 numbers of today's build).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

if sys.platform != "linux" or importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("compiling kernels offline needs NVVM and nvJitLink (Linux wheels)", allow_module_level=True)

from bench_modules import load_bench  # noqa: E402

from kernels.cuda import decode, decode_policy, decode_split  # noqa: E402
from kernels.cuda._host import spec_for  # noqa: E402

SMS = 132  # H100 SXM and H200


def _kernel_sass():
    return load_bench("kernel_sass")


KS = _kernel_sass()
pytestmark = pytest.mark.skipif(KS.nvjitlink_version() is None,
                                reason="needs the nvidia-nvjitlink wheel (production linker)")


def _blocks_per_sm(name: str) -> int:
    (variant,) = [v for v in KS.catalog(quick=True) if v.name == name]
    _, _, threads, _, _ = KS.build(variant)
    with tempfile.TemporaryDirectory() as tmp:
        _, info = KS.link_nvjitlink(KS.variant_ptx(variant), Path(tmp))
    assert info["spill_bytes"] == 0, info
    return KS.blocks_per_sm(info["registers"], info["shared_bytes"], threads)


@pytest.fixture(scope="module")
def built() -> dict[str, int]:
    return {"decode": _blocks_per_sm("decode f16 d128 bs16 g4"),
            "split": _blocks_per_sm("split f16 d128 bs16 g4")}


def test_policy_on_the_built_kernels_never_overfills_the_split_kernel(built, monkeypatch) -> None:
    one_pass_kernel, split_kernel = object(), object()
    monkeypatch.setattr(decode, "decode_kernel", lambda spec: one_pass_kernel)
    monkeypatch.setattr(decode_split, "split_kernel", lambda spec: split_kernel)
    per_kernel = {id(one_pass_kernel): built["decode"] * SMS, id(split_kernel): built["split"] * SMS}
    monkeypatch.setattr(decode, "kernel_resident_blocks",
                        lambda kernel, signature, threads: per_kernel[id(kernel)])
    decode.resident_blocks.cache_clear()
    try:
        spec = spec_for(128, 16, 8, 4, "f16", "f16", "f16", "decode")
        occupancy = decode.resident_blocks(spec)
    finally:
        decode.resident_blocks.cache_clear()
    assert occupancy == decode_policy.Occupancy(built["decode"] * SMS, built["split"] * SMS)
    # today's build: 80 registers (6 blocks/SM) and 95 (5 blocks/SM)
    assert (built["decode"], built["split"]) == (6, 5)
    heads_grid = spec.num_kv_heads * spec.row_blocks
    for batch in (1, 2, 4, 8, 16, 32, 48, 64, 128, 256):
        for ctx in (1024, 4096, 32768, 1 << 20):
            parts = decode_policy.uniform_parts(batch, ctx, heads_grid, occupancy)
            blocks = batch * parts * heads_grid
            if parts > 1:
                assert blocks <= occupancy.split or \
                    decode_policy.wave_efficiency(blocks, occupancy.split) >= 0.85, (batch, ctx)
