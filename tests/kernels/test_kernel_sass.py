"""The performance gate without a GPU: sm_90 machine code of the shipped kernel variants.

Every variant is built by both toolchains: the standalone `ptxas` and nvJitLink (what
numba-cuda links with on a GPU host; the budgets apply to it). Fails when a kernel spills,
needs more registers than its launch can hold (the head_dim 256 prefill case of issue 13), or
loads its K/V stream in pieces narrower than 8 bytes, and when the decode benchmark variant
misses its budgets (issue 22: <= 88 registers, 0 spills, <= 16 SASS instructions per 16 bytes
of K/V in the steady-state loop) or the prefill benchmark variant its own (>= 64 query rows
per block, >= 3 blocks/SM, 0 spills, <= 7 SASS instructions per HMMA in its tile loop: a
ceiling that only moves down, issue 43). Needs `ptxas`, `nvdisasm` and the `nvidia-nvjitlink`
wheel (skipped otherwise, with the reason); `bench/kernel_sass.py` prints the full table.
"""

from __future__ import annotations

import json

import pytest
from bench_modules import load_bench


def _kernel_sass():
    return load_bench("kernel_sass")


KS = _kernel_sass()
PTXAS = KS.find_tool("ptxas")
NVDISASM = KS.find_tool("nvdisasm")
JITLINK = KS.nvjitlink_version()
needs_tools = pytest.mark.skipif(
    PTXAS is None or NVDISASM is None or JITLINK is None,
    reason=f"needs ptxas (found: {PTXAS}), nvdisasm (found: {NVDISASM}) and nvJitLink "
           f"(found: {JITLINK}); install CUDA's ptxas and `pip install nvidia-cuda-nvdisasm "
           "nvidia-nvjitlink`")

# By default the two benchmark variants, whose budgets are the performance gate; every kernel
# and mode still compiles for sm_90 by default in test_cuda_compile_ptx. The other variants'
# machine code with --slow (~2-5 CPU-s each: NVVM, ptxas, nvJitLink, nvdisasm).
_SLOW = pytest.mark.slow
GATED = [
    KS.DECODE_BENCH,  # the benchmark variant: the tight budgets apply
    KS.PREFILL_BENCH,  # FA2 class: >= 64 query rows per block, >= 3 blocks/SM, instr/HMMA
    pytest.param("decode bf16 d128 bs16 g4", marks=_SLOW),
    pytest.param("split f16 d128 bs16 g4", marks=_SLOW),
    pytest.param("decode f32 d128 bs16 g4", marks=_SLOW),  # SIMT path
    pytest.param("decode f32 d256 bs16 g1", marks=_SLOW),  # SIMT: the widest rows in shared memory
    pytest.param("prefill f16 d256 bs16 g4", marks=_SLOW),  # could not launch before (512 x 160 regs)
    pytest.param("reduce f16 d128", marks=_SLOW),
    pytest.param("write f16 d128", marks=_SLOW),
    pytest.param("copy bf16 d128", marks=_SLOW),
]


@needs_tools
@pytest.mark.parametrize("name", GATED)
def test_variant_within_budget(name: str) -> None:
    variant = next(v for v in KS.catalog(quick=False) if v.name == name)
    report = KS.analyze(variant, PTXAS, NVDISASM)
    assert KS.check(report) == [], KS.table([report])
    assert report.blocks_per_sm >= 1
    if report.kv_bytes_per_trip:
        assert report.instr_per_16b is not None
    assert report.toolchain == "nvjitlink" and report.registers_nvjitlink is not None
    assert report.registers > 0 and report.blocks_per_sm_ptxas >= 1  # ptxas reported too
    if name == KS.DECODE_BENCH:
        assert report.registers_nvjitlink <= KS.BENCH_MAX_REGS == 88
        assert report.spill_bytes == 0 and report.blocks_per_sm >= 6
        assert report.instr_per_16b <= KS.BENCH_MAX_INSTR_PER_16B
        assert set(report.kv_load_widths) == {"128-bit"}
    if name == KS.PREFILL_BENCH:
        assert report.query_rows_per_cta >= 64 and report.blocks_per_sm >= 3
        assert report.spill_bytes == 0 and report.instr_per_16b is not None
        assert report.instr_per_hmma <= KS.PREFILL_MAX_INSTR_PER_HMMA and report.hmma_per_trip >= 32
        assert set(report.kv_load_widths) == {"128-bit"}


@needs_tools
def test_json_carries_both_toolchains(tmp_path) -> None:
    out = tmp_path / "sass.json"
    KS.main(["--only", KS.DECODE_BENCH, "--json", str(out)])
    (row,) = json.loads(out.read_text())
    for key in ("registers", "registers_nvjitlink", "spill_bytes", "blocks_per_sm",
                "instr_per_16b", "query_rows_per_cta"):
        assert key in row, key
    assert row["query_rows_per_cta"] == 4  # the decode benchmark: one GQA group of 4


def test_budgets_apply_to_the_production_build() -> None:
    """Hand-made reports: nvJitLink's registers are judged, not ptxas's; the prefill tile."""
    base = dict(spill_bytes=0, stack_bytes=0, shared_bytes=36352, threads=128, blocks_per_sm=5,
                load_widths={"128-bit": 8}, kv_load_widths={"128-bit": 8}, loop_instructions=200,
                kv_bytes_per_trip=256, instr_per_16b=12.5, toolchain="nvjitlink")
    decode = KS.Report(KS.DECODE_BENCH, registers=84, registers_nvjitlink=96, **base)
    assert any("96 registers (nvjitlink) > 88" in p for p in KS.check(decode))
    assert KS.check(KS.Report(KS.DECODE_BENCH, registers=96, registers_nvjitlink=80, **base)) == []
    small = KS.Report(KS.PREFILL_BENCH, registers=170, registers_nvjitlink=170,
                      query_rows_per_cta=16, instr_per_hmma=7.2, **dict(base, blocks_per_sm=2))
    problems = KS.check(small)
    assert any("16 query rows" in p for p in problems)
    assert any("2 blocks/SM < 3" in p for p in problems)
    assert any("7.2 instructions per HMMA" in p for p in problems)
    fa2 = KS.Report(KS.PREFILL_BENCH, registers=160, registers_nvjitlink=160,
                    query_rows_per_cta=64, instr_per_hmma=6.5, **dict(base, blocks_per_sm=3))
    assert KS.check(fa2) == []


def test_per_hmma_counts_inner_loops_per_trip() -> None:
    """A tile loop with an inner loop of 2 trips: its instructions count twice, the outer
    ones once; guards and modifiers are stripped from the mnemonics."""
    code = [
        ".L_x_0:",
        "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]",   # outer: 2 instructions
        "BAR.SYNC.DEFER_BLOCKING 0x0",
        ".L_x_1:",
        "HMMA.16816.F32 R8, R12, R16, R8",             # inner: 4 instructions, 2 trips
        "@P1 FMUL R9, R9, R10",
        "@!P2 FMUL R11, R11, R10",
        "@P0 BRA `(.L_x_1)",
        "@P3 BRA `(.L_x_0)",                           # outer
        "EXIT",
    ]
    assert KS.opcode("@!P2 FMUL R11, R11, R10") == "FMUL"
    assert KS.opcode("@UP0 HMMA.16816.F32 R8, R12, R16, R8") == "HMMA"
    assert KS.weighted_mix(code, 0, 8, 2) == {"LDGSTS": 1, "BAR": 1, "HMMA": 2, "FMUL": 4,
                                              "BRA": 3}
    # 11 instructions per trip of the tile loop, 2 HMMA: 5.5 per HMMA, 2 FMUL per HMMA
    assert KS.hmma_figures(code, (0, 8), 2) == KS.HmmaFigures(2, 5.5, 2.0, 5.5, 2.0)
    assert KS.hmma_figures(code, (0, 8), None) is None  # trips unknown: no figure


def test_per_hmma_without_the_skipped_rescale() -> None:
    """A block of 16 FMULs a warp-uniform branch jumps over (the O rescale a vote skips) is
    counted in the figure and left out of its `_skip` twin; a short block is not a rescale."""
    rescale = [f"FMUL R{i}, R{i}, R200" for i in range(16)]
    code = [
        ".L_x_0:",
        "HMMA.16816.F32 R8, R12, R16, R8",
        "VOTE.ANY P1, P1",
        "@!P1 BRA `(.L_x_1)",
        *rescale,
        ".L_x_1:",
        "HMMA.16816.F32 R8, R12, R16, R8",
        "@P2 BRA `(.L_x_2)",
        "FMUL R4, R4, R5",  # one FMUL skipped: not a rescale block
        ".L_x_2:",
        "@P3 BRA `(.L_x_0)",
        "EXIT",
    ]
    last = len(code) - 2
    assert KS.skippable_rescales(code, 0, last) == [(4, 19)]
    # 23 instructions, 2 HMMA, 17 FMUL; without the rescale block 7 and 1
    assert KS.hmma_figures(code, (0, last), None) == KS.HmmaFigures(2, 11.5, 8.5, 3.5, 0.5)


def test_analysis_reads_machine_code() -> None:
    """The gate's own parsing, on hand-written SASS: loops, K/V loads, widths, occupancy."""
    code = [
        "MOV R1, c[0x0][0x28]",
        ".L_x_0:",
        "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]",
        "LDG.E.CONSTANT R6, desc[UR4][R8.64]",
        "@!PT LDS RZ, [RZ]",
        "HMMA.16816.F32 R8, R12, R16, R8",
        "@P0 BRA `(.L_x_0)",
        "LDG.E.U16 R3, desc[UR4][R4.64]",
        "EXIT",
        ".L_x_9:",  # a diverged-warp slow path after the last EXIT, branching back: no loop
        "SHFL.BFLY P0, R5, R6, R7, R8",
        "BRA `(.L_x_0)",
    ]
    assert KS.loops(code) == [(1, 6)]
    assert KS.steady_loop(code) == (1, 6)
    assert KS.instructions(code, 1, 6) == 4  # label and never-issued @!PT slot excluded
    assert KS.load_widths(code) == {"128-bit": 1, "32-bit": 1, "16-bit": 1}
    assert KS.load_widths(code, kv_only=True) == {"128-bit": 1}
    # sm_90: 65536 registers, 2048 threads, 228 KB shared memory per SM
    assert KS.blocks_per_sm(96, 35328, 128) == 5
    assert KS.blocks_per_sm(240, 19360, 128) == 2
    assert KS.blocks_per_sm(160, 35648, 512) == 0  # the seed's head_dim 256 prefill
    assert KS.hmma_figures(code, (1, 6), None) == KS.HmmaFigures(1, 4.0, 0.0, 4.0, 0.0)
    narrow = KS.Report("x", 64, 0, 0, 0, 128, 8, {}, {"16-bit": 4}, 10, 64, 2.5)
    assert any("narrower" in p for p in KS.check(narrow))
