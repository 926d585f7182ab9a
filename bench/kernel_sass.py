"""Performance gate without a GPU: the machine code of every shipped CUDA kernel variant.

Each variant is compiled the way the GPU would build it — `numba.cuda.compile_ptx(cc=(9, 0))`,
then `ptxas -v -arch=sm_90` (the PTX `.version` is lowered to what the local ptxas accepts; the
kernels use nothing newer), then disassembled with `nvdisasm` — and reported:

- registers per thread, spill bytes, static shared memory, and the thread blocks per SM that
  the registers, shared memory and thread count allow on an H100/H200 (sm_90);
- the widths of the global loads (`LDG`, and `LDGSTS` = `cp.async` into shared memory) in the
  whole kernel, and of the K/V stream (`cp.async`, or loads tagged `.L2::128B`);
- the steady-state tile loop: the loop that issues the K/V loads, its SASS instruction count,
  and instructions per 16 bytes of K/V each thread loads per trip (bytes from the variant's
  geometry: tokens per warp step x head_dim x element size x 2 (K and V) / 32 lanes; for the
  FA2-class prefill, the block's tile x head_dim x element size x 2 / threads — there every
  staged byte then serves 64 query rows, so its count is not comparable with decode's);
- in that loop, SASS instructions and FMULs per HMMA (tensor-core variants): the work around
  each tensor-core instruction, the prefill loop's own measure (issue 43; FA2's ≈ 3). An
  instruction inside a loop nested in the tile loop counts once per trip of it (the FA2
  prefill's slices per tile), so the figure is per executed trip, not a lower bound. A block
  of FMULs that a branch jumps over (the O rescale, skipped by a warp vote when no row maximum
  rose) is counted in the first figure and left out of the second, "(no rescale)".

    .venv/bin/python bench/kernel_sass.py [--json OUT.json] [--quick] [--only NAME]

Two toolchains build every variant: the standalone `ptxas` and nvJitLink (the
`nvidia-nvjitlink` wheel through `cuda.bindings.nvjitlink`, with the option numba-cuda's
linker passes on a GPU host: `-arch=sm_90`; the launch bounds travel in the PTX). They
differ: under the same bounds ptxas 13.0 gave the decode kernel 91 registers, nvJitLink 13.5
gave 96. The report carries both (`registers`: ptxas, `registers_nvjitlink`); every
other machine-code figure (spills, blocks/SM, SASS loop) is the production build's, nvJitLink
when it is installed (`toolchain` says which), and its ptxas twin is kept as `*_ptxas`.
Budgets (`check`) apply to the production build.

Needs `ptxas` (PATH, $PTXAS, or /usr/local/cuda/bin) and `nvdisasm` (PATH, $NVDISASM, or the
`nvidia-cuda-nvdisasm` wheel); nvJitLink is optional (`pip install nvidia-nvjitlink`), its
absence is reported. Exit status 1 when a variant fails its budget (`check`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types as pytypes
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CC = (9, 0)
SM90_REGS = 65536
SM90_SMEM = 233472  # bytes of shared memory per SM (228 KB)
SM90_SMEM_RESERVED = 1024  # per block, reserved by the driver
SM90_MAX_THREADS = 2048
SM90_MAX_BLOCKS = 32
LOAD_BYTES = {"128": 16, "64": 8, "": 4, "U16": 2, "S16": 2, "U8": 1, "S8": 1}

# Budgets of the decode benchmark variant (issues 13, 22) and of every variant. 88 registers
# (not the launch bound's 96): headroom, so growth shows up here before it spills.
DECODE_BENCH = "decode f16 d128 bs16 g4"
BENCH_MAX_REGS = 88
BENCH_MAX_INSTR_PER_16B = 16.0
# The prefill benchmark variant (issue 22): an FA2-class query tile and three resident blocks.
PREFILL_BENCH = "prefill f16 d128 bs16 g4"
PREFILL_MIN_ROWS = 64
PREFILL_MIN_BLOCKS = 3  # 12 warps per SM (issue 43: registers fitted, `prefill_launch_bounds`)
# Issue 43's steps, each measured on its own: a ceiling that only moves down (9.58 before them,
# 6.47 with one softmax update per 32-token tile; FA2's algorithm ~3, the 64-token tile
# rewrite aims at <= 4), so a regression shows here.
PREFILL_MAX_INSTR_PER_HMMA = 7.0


@dataclass
class Report:
    name: str
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int
    threads: int
    blocks_per_sm: int
    load_widths: dict[str, int]
    kv_load_widths: dict[str, int]
    loop_instructions: int | None
    kv_bytes_per_trip: int | None
    instr_per_16b: float | None
    notes: list[str] = field(default_factory=list)
    toolchain: str = "ptxas"  # the production build the figures above describe
    registers_nvjitlink: int | None = None
    spill_bytes_ptxas: int = 0
    blocks_per_sm_ptxas: int = 0
    instr_per_16b_ptxas: float | None = None
    query_rows_per_cta: int | None = None  # attention kernels: query rows one block holds
    hmma_per_trip: float | None = None  # tensor-core loops: HMMA per tile-loop trip (inner loops x trips)
    instr_per_hmma: float | None = None  # SASS instructions per HMMA in the tile loop, same weights
    fmul_per_hmma: float | None = None  # FMUL per HMMA there (the O rescale is most of them)
    instr_per_hmma_skip: float | None = None  # the same on trips whose O rescale a vote skips
    fmul_per_hmma_skip: float | None = None

    @property
    def production_registers(self) -> int:
        return self.registers_nvjitlink if self.registers_nvjitlink is not None else self.registers


# --------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------

def find_tool(name: str) -> str | None:
    env = os.environ.get(name.upper())
    if env and Path(env).exists():
        return env
    found = shutil.which(name)
    if found:
        return found
    for candidate in (Path("/usr/local/cuda/bin") / name,):
        if candidate.exists():
            return str(candidate)
    if name == "nvdisasm":
        try:
            import nvidia

            for base in nvidia.__path__:
                for path in Path(base).glob("*/bin/nvdisasm"):
                    return str(path)
        except ImportError:
            pass
    return None


def ptxas_version(ptxas: str) -> tuple[int, int]:
    """The newest PTX ISA the local ptxas accepts (CUDA 12.x → 8.x, 13.0 → 9.0)."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    major, minor = (int(m.group(1)), int(m.group(2))) if m else (12, 0)
    return (9, 0) if major >= 13 else (8, min(minor, 8))


def compile_ptx(pyfunc: Any, signature: tuple[Any, ...], launch_bounds: Any = None) -> str:
    """PTX for sm_90 with no GPU present (Numba asks the 'current device' for its CC)."""
    from numba import cuda
    from numba.cuda import dispatcher

    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC)
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, signature, cc=CC, launch_bounds=launch_bounds)
    finally:
        dispatcher.get_current_device = original
    return ptx


# Compiling a variant to PTX (Numba typing + NVVM) is most of a variant's cost; ptxas, nvJitLink
# and nvdisasm take a fraction of a second. The test suite builds several variants in two files
# (the PTX checks and the SASS gate, on different pytest-xdist workers), so it points this
# variable at a directory of its run and each variant is compiled once per run.
PTX_CACHE_ENV = "PAGEDKV_PTX_CACHE_DIR"


def variant_ptx(variant: Variant) -> str:
    """PTX of `variant` as the kernel files build it, reused from $PAGEDKV_PTX_CACHE_DIR when
    set: keyed by the variant, every kernel source file, this file and the compiler versions,
    so a changed kernel is compiled anew."""
    cache = os.environ.get(PTX_CACHE_ENV)
    if not cache:
        pyfunc, signature, _, _, bounds = build(variant)
        return compile_ptx(pyfunc, signature, launch_bounds=bounds)
    import fcntl

    path = Path(cache) / f"{_ptx_key(variant)}.ptx"
    path.parent.mkdir(parents=True, exist_ok=True)
    # One compile per variant: a second process asking for it meanwhile (the other test file on
    # the other worker) waits for the first one's result instead of compiling it too.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path.read_text()
        pyfunc, signature, _, _, bounds = build(variant)
        ptx = compile_ptx(pyfunc, signature, launch_bounds=bounds)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")   # write-then-rename: whole or absent
        tmp.write_text(ptx)
        tmp.replace(path)
        return ptx


def _ptx_key(variant: Variant) -> str:
    import hashlib

    import numba

    axes = {k: v for k, v in asdict(variant).items() if k != "name"}   # the name is a label only
    digest = hashlib.sha256(repr((axes, CC, numba.__version__, _numba_cuda_version())).encode())
    kernel_dir = Path(__file__).resolve().parents[1] / "kernels" / "cuda"
    for source in (*sorted(kernel_dir.glob("*.py")), Path(__file__).resolve()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:32]


def _numba_cuda_version() -> str:
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:   # not installed as a distribution (a source checkout): the sources decide
        return "?"


def assemble(ptx: str, ptxas: str, workdir: Path) -> tuple[Path, dict[str, int]]:
    """ptxas -v: (cubin, {registers, spill_bytes, shared_bytes})."""
    major, minor = ptxas_version(ptxas)
    ptx = re.sub(r"^\.version \d+\.\d+", f".version {major}.{minor}", ptx, count=1, flags=re.MULTILINE)
    src, cubin = workdir / "k.ptx", workdir / "k.cubin"
    src.write_text(ptx)
    proc = subprocess.run([ptxas, "-v", f"-arch=sm_{CC[0]}{CC[1]}", str(src), "-o", str(cubin)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed:\n{proc.stderr[-2000:]}")
    return cubin, _resource_usage(proc.stderr)


def nvjitlink_version() -> tuple[int, int] | None:
    """nvJitLink's version when the library loads (the `nvidia-nvjitlink` wheel), else None."""
    try:
        from cuda.bindings import nvjitlink

        return tuple(nvjitlink.version())  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - missing wheel, missing library: both mean "absent"
        return None


def link_nvjitlink(ptx: str, workdir: Path) -> tuple[Path, dict[str, int]]:
    """Build the PTX as numba-cuda does on a GPU host (nvJitLink, `-arch=sm_90`; the kernels
    set no `max_registers`, their launch bounds are in the PTX): (cubin, {registers,
    spill_bytes, stack_bytes, shared_bytes}) from the link's verbose log."""
    from cuda.bindings import nvjitlink

    options = [f"-arch=sm_{CC[0]}{CC[1]}", "-verbose"]
    handle = nvjitlink.create(len(options), options)
    try:
        data = ptx.encode()
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "k.ptx")
            nvjitlink.complete(handle)
        except Exception as exc:
            size = nvjitlink.get_error_log_size(handle)
            log = bytearray(size)
            nvjitlink.get_error_log(handle, log)
            raise RuntimeError(f"nvJitLink failed: {log.decode(errors='replace')[-2000:]}") from exc
        size = nvjitlink.get_info_log_size(handle)
        log = bytearray(size)
        nvjitlink.get_info_log(handle, log)
        size = nvjitlink.get_linked_cubin_size(handle)
        cubin = bytearray(size)
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    path = workdir / "k.nvjitlink.cubin"
    path.write_bytes(bytes(cubin))
    return path, _resource_usage(log.decode(errors="replace"))


def _resource_usage(info: str) -> dict[str, int]:
    """Registers, spills, stack and static shared memory from a `ptxas -v`-style log."""
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", info)
    stack = re.search(r"(\d+) bytes stack frame", info)
    smem = re.search(r"(\d+) bytes smem", info)
    return {"registers": int(regs.group(1)) if regs else 0,
            "spill_bytes": sum(int(s) for s in spills),
            "stack_bytes": int(stack.group(1)) if stack else 0,
            "shared_bytes": int(smem.group(1)) if smem else 0}


def disassemble(cubin: Path, nvdisasm: str) -> list[str]:
    """SASS instructions (labels kept as '.L...:' entries), in address order."""
    out = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    code: list[str] = []
    for line in out.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            code.append(re.sub(r"\s+", " ", m.group(1)))
        elif re.match(r"\.L_x_\d+:", line.strip()):
            code.append(line.strip())
    return code


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------

def blocks_per_sm(registers: int, shared_bytes: int, threads: int) -> int:
    """Resident thread blocks per SM on sm_90 (register file, shared memory, threads)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = (SM90_REGS // regs_per_warp) // warps
    by_smem = SM90_SMEM // (shared_bytes + SM90_SMEM_RESERVED)
    return min(by_regs, by_smem, SM90_MAX_THREADS // threads, SM90_MAX_BLOCKS)


def is_kv_load(instr: str) -> bool:
    """The K/V stream: `cp.async` copies into shared memory (LDGSTS) or `.L2::128B` loads."""
    return "LDGSTS" in instr or ("LDG" in instr and "LTC128B" in instr)


def _load_width(instr: str) -> str | None:
    m = re.search(r"\bLDG(?:STS)?\.E((?:\.[A-Z0-9]+)*)", instr)
    if not m:
        return None
    mods = [x for x in m.group(1).split(".") if x]
    for mod in mods:
        if mod in LOAD_BYTES:
            return f"{8 * LOAD_BYTES[mod]}-bit"
    return "32-bit"


def load_widths(code: list[str], kv_only: bool = False) -> dict[str, int]:
    widths: dict[str, int] = {}
    for instr in code:
        width = _load_width(instr)
        if width and (not kv_only or is_kv_load(instr)):
            widths[width] = widths.get(width, 0) + 1
    return widths


def loops(code: list[str]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every loop: a branch back to an earlier label.

    ptxas places the slow paths of warp-synchronous instructions (taken when a warp is
    diverged) after the kernel's last EXIT, and they branch back into the body; those are not
    loops, so branches after the last EXIT are ignored.
    """
    labels = {line[:-1]: i for i, line in enumerate(code) if line.endswith(":")}
    exits = [i for i, line in enumerate(code) if re.search(r"\bEXIT\b", line)]
    end = exits[-1] if exits else len(code)
    found = []
    for i, instr in enumerate(code[:end]):
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", instr)
        if m and labels.get(m.group(1), i + 1) <= i:
            found.append((labels[m.group(1)], i))
    return found


def steady_loop(code: list[str]) -> tuple[int, int] | None:
    """The loop that issues the most K/V stream loads (the innermost of equals): the step
    loop, whose every trip stages one step's K and V tiles."""
    candidates = [(sum(1 for i in range(a, b + 1) if is_kv_load(code[i])), -(b - a), (a, b))
                  for a, b in loops(code)]
    candidates = [c for c in candidates if c[0]]
    return max(candidates)[2] if candidates else None


def nested_loops(code: list[str], first: int, last: int) -> int:
    """Loops strictly inside [first, last]: their trips make a static count a lower bound."""
    return sum(1 for a, b in loops(code) if first <= a and b <= last and (a, b) != (first, last))


def opcode(instr: str) -> str:
    """The mnemonic of a SASS instruction: predicate guard and modifiers stripped."""
    return re.sub(r"^@!?U?P[T0-9]+ ", "", instr).split(" ")[0].split(".")[0]


def weighted_mix(code: list[str], first: int, last: int, inner_trips: int,
                 skip: list[tuple[int, int]] | None = None) -> dict[str, float]:
    """Opcode counts of one trip of the loop [first, last], an instruction inside k nested
    loops counted inner_trips**k times (their trip count: the kernel's geometry knows it);
    instructions in the `skip` ranges left out."""
    inner = [(a, b) for a, b in loops(code) if first <= a and b <= last and (a, b) != (first, last)]
    mix: dict[str, float] = {}
    for i in range(first, last + 1):
        line = code[i]
        if line.endswith(":") or line.startswith("@!PT ") or any(a <= i <= b for a, b in skip or ()):
            continue
        depth = sum(1 for a, b in inner if a <= i <= b)
        op = opcode(line)
        mix[op] = mix.get(op, 0) + inner_trips ** depth
    return mix


def skippable_rescales(code: list[str], first: int, last: int) -> list[tuple[int, int]]:
    """Ranges of the loop that a forward conditional branch jumps over and that are a block
    of FMULs (>= 16, >= 3/4 of the range): the O rescale a warp vote skips when no row
    maximum rose (the FA2-class prefill, issue 43)."""
    labels = {line[:-1]: i for i, line in enumerate(code) if line.endswith(":")}
    found = []
    for i in range(first, last + 1):
        m = re.match(r"@!?U?P\d BRA `\((\.L_x_\d+)\)", code[i])
        target = labels.get(m.group(1), -1) if m else -1
        if not i < target <= last:
            continue
        body = [opcode(x) for x in code[i + 1:target] if not x.endswith(":")]
        fmul = body.count("FMUL")
        if fmul >= 16 and 4 * fmul >= 3 * len(body):
            found.append((i + 1, target - 1))
    return found


@dataclass(frozen=True)
class HmmaFigures:
    """Per-HMMA figures of a tile loop (one trip, inner loops weighted by their trips); the
    `*_skip` ones on the trips where the warp vote skips the O rescale (equal to the others
    when the loop has no skippable rescale)."""

    hmma: float
    instr: float
    fmul: float
    instr_skip: float
    fmul_skip: float


def hmma_figures(code: list[str], loop: tuple[int, int] | None,
                 inner_trips: int | None) -> HmmaFigures | None:
    """The loop's per-HMMA figures; None when it has no HMMA, or inner loops of unknown trip
    count."""
    if loop is None or (nested_loops(code, *loop) and inner_trips is None):
        return None
    mix = weighted_mix(code, *loop, inner_trips or 1)
    hmma = mix.get("HMMA", 0)
    if not hmma:
        return None
    fast = weighted_mix(code, *loop, inner_trips or 1, skippable_rescales(code, *loop))
    return HmmaFigures(hmma, round(sum(mix.values()) / hmma, 2), round(mix.get("FMUL", 0) / hmma, 2),
                       round(sum(fast.values()) / hmma, 2), round(fast.get("FMUL", 0) / hmma, 2))


def instructions(code: list[str], first: int, last: int) -> int:
    """SASS instructions in code[first:last+1]; labels and never-executed `@!PT` slots (ptxas
    pads `LDGSTS` with them) are not instructions that issue."""
    return sum(1 for line in code[first:last + 1]
               if not line.endswith(":") and not line.startswith("@!PT "))


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # decode | split | prefill | reduce | write | copy
    head_dim: int = 128
    block_size: int = 16
    group: int = 4
    dtype: str = "f16"
    num_kv_heads: int = 8


def catalog(quick: bool = False) -> list[Variant]:
    """Every shipped variant family at the sizes models use (quick: one of each axis value)."""
    out: list[Variant] = []
    dims = (128,) if quick else (64, 128, 256)
    groups = (4,) if quick else (1, 4, 8)
    kinds = ("f16", "bf16", "f32")
    for mode in ("decode", "split", "prefill"):
        for dtype in kinds:
            for head_dim in dims:
                for group in groups:
                    out.append(Variant(f"{mode} {dtype} d{head_dim} bs16 g{group}", mode,
                                       head_dim, 16, group, dtype))
    if quick:
        out.append(Variant("prefill f16 d256 bs16 g4", "prefill", 256, 16, 4, "f16"))
        out.append(Variant("decode f16 d64 bs16 g8", "decode", 64, 16, 8, "f16"))
    for dtype in kinds:
        out.append(Variant(f"reduce {dtype} d128", "reduce", 128, dtype=dtype))
        out.append(Variant(f"write {dtype} d128", "write", 128, dtype=dtype))
        out.append(Variant(f"copy {dtype} d128", "copy", 128, dtype=dtype))
    return out


def build(variant: Variant) -> tuple[Any, tuple[Any, ...], int, int | None, Any]:
    """(python kernel, signature, threads per block, K/V bytes per loop trip per thread,
    launch bounds) — exactly as the kernel files compile them for a GPU."""
    from kernels.cuda import block_copy, decode, decode_reduce, decode_split, prefill, slot_write
    from kernels.cuda._spec import KIND_BYTES, TC_STEP_TOKENS, AttentionSpec

    v = variant
    if v.kind in ("decode", "split", "prefill"):
        spec = AttentionSpec(v.head_dim, v.block_size, v.num_kv_heads, v.group, v.dtype, v.dtype,
                             v.dtype, v.kind)
        spec.check()
        builders = {"decode": (decode.build_decode_kernel, decode.DECODE_SIGNATURE),
                    "split": (decode_split.build_split_kernel, decode_split.SPLIT_SIGNATURE),
                    "prefill": (prefill.build_prefill_kernel, prefill.PREFILL_SIGNATURE)}
        make, signature = builders[v.kind]
        tokens = TC_STEP_TOKENS if spec.path == "tc" else spec_simt_tokens(spec)
        kv_bytes = 2 * tokens * v.head_dim * KIND_BYTES[v.dtype] // 32  # one warp's step
        if v.kind == "prefill" and spec.path == "tc":  # FA2: the block stages a shared tile
            from kernels.cuda._fa2_prefill import fa2_geometry

            tile_tokens = TC_STEP_TOKENS * fa2_geometry(spec)[2]
            kv_bytes = 2 * tile_tokens * v.head_dim * KIND_BYTES[v.dtype] // spec.num_threads
        bounds = (prefill.prefill_launch_bounds(spec) if v.kind == "prefill"
                  else decode.launch_bounds(spec))
        return make(spec), signature, spec.num_threads, kv_bytes, bounds
    if v.kind == "reduce":
        return (decode_reduce.build_reduce_kernel(v.head_dim, v.group * v.num_kv_heads, v.dtype),
                decode_reduce.REDUCE_SIGNATURE, decode_reduce.THREADS, None,
                (decode_reduce.THREADS, 1))
    if v.kind == "write":
        return (slot_write.build_write_kernel(v.num_kv_heads, v.block_size, v.head_dim, v.dtype),
                slot_write.WRITE_SIGNATURE, slot_write.THREADS, None, (slot_write.THREADS, 1))
    return (block_copy.build_copy_kernel(v.num_kv_heads, v.block_size, v.head_dim, v.dtype),
            block_copy.COPY_SIGNATURE, block_copy.THREADS, None, (block_copy.THREADS, 1))


def inner_trips(variant: Variant) -> int | None:
    """Trip count of the loops nested in a variant's tile loop, when its geometry fixes one:
    the FA2-class prefill's slices per tile (the only tensor-core loop that may keep one)."""
    spec = _spec_of(variant)
    if spec is None or spec.mode != "prefill" or spec.path != "tc":
        return None
    from kernels.cuda._fa2_prefill import fa2_geometry

    return fa2_geometry(spec)[2]


def spec_simt_tokens(spec: Any) -> int:
    from kernels.cuda._simt_attend import step_tokens

    return step_tokens(spec)


def _machine_code(cubin: Path, info: dict[str, int], nvdisasm: str | None, kv_bytes: int | None,
                  threads: int, trips: int | None = None) -> dict[str, Any]:
    """The SASS figures of one build."""
    code = disassemble(cubin, nvdisasm) if nvdisasm else []
    loop = steady_loop(code) if code else None
    loop_instr = instructions(code, *loop) if loop else None
    per_16b = (loop_instr / (kv_bytes / 16)) if loop_instr and kv_bytes else None
    notes = []
    if kv_bytes and code and loop is None:
        notes.append("no steady-state K/V loop found")
    if loop and nested_loops(code, *loop):
        notes.append("step loop not fully unrolled: instructions per 16 B is a lower bound")
    return {"code": code, "loop_instr": loop_instr, "notes": notes,
            "hmma": hmma_figures(code, loop, trips) if code else None,
            "per_16b": round(per_16b, 2) if per_16b else None,
            "blocks": blocks_per_sm(info["registers"], info["shared_bytes"], threads)}


def analyze(variant: Variant, ptxas: str, nvdisasm: str | None,
            nvjitlink: bool | None = None) -> Report:
    """Build `variant` with ptxas and (when installed, or when `nvjitlink` is True) with
    nvJitLink; the report's machine-code figures are nvJitLink's when it built."""
    _, _, threads, kv_bytes, _ = build(variant)
    ptx = variant_ptx(variant)
    use_jitlink = nvjitlink_version() is not None if nvjitlink is None else nvjitlink
    with tempfile.TemporaryDirectory() as tmp:
        cubin, info = assemble(ptx, ptxas, Path(tmp))
        trips = inner_trips(variant)
        by_ptxas = _machine_code(cubin, info, nvdisasm, kv_bytes, threads, trips)
        prod_info, prod = info, by_ptxas
        if use_jitlink:
            jit_cubin, prod_info = link_nvjitlink(ptx, Path(tmp))
            prod = _machine_code(jit_cubin, prod_info, nvdisasm, kv_bytes, threads, trips)
    notes = list(prod["notes"])
    if re.search(r"\.f64\b", ptx):
        notes.append("float64 instructions in PTX")
    code = prod["code"]
    return Report(
        name=variant.name, registers=info["registers"], spill_bytes=prod_info["spill_bytes"],
        stack_bytes=prod_info["stack_bytes"], shared_bytes=prod_info["shared_bytes"],
        threads=threads, blocks_per_sm=prod["blocks"],
        load_widths=load_widths(code), kv_load_widths=load_widths(code, kv_only=True),
        loop_instructions=prod["loop_instr"], kv_bytes_per_trip=kv_bytes,
        instr_per_16b=prod["per_16b"], notes=notes,
        toolchain="nvjitlink" if use_jitlink else "ptxas",
        registers_nvjitlink=prod_info["registers"] if use_jitlink else None,
        spill_bytes_ptxas=info["spill_bytes"], blocks_per_sm_ptxas=by_ptxas["blocks"],
        instr_per_16b_ptxas=by_ptxas["per_16b"], query_rows_per_cta=query_rows_of(variant),
        **_hmma_fields(prod["hmma"]))


def _hmma_fields(fig: HmmaFigures | None) -> dict[str, float | None]:
    return {"hmma_per_trip": fig.hmma if fig else None,
            "instr_per_hmma": fig.instr if fig else None,
            "fmul_per_hmma": fig.fmul if fig else None,
            "instr_per_hmma_skip": fig.instr_skip if fig else None,
            "fmul_per_hmma_skip": fig.fmul_skip if fig else None}


def query_rows_of(variant: Variant) -> int | None:
    """Query rows (tokens x GQA heads) one thread block of an attention variant holds."""
    spec = _spec_of(variant)
    if spec is None:
        return None
    from kernels.cuda.prefill import query_rows_per_cta

    return query_rows_per_cta(spec) if spec.mode == "prefill" else spec.rows


def _spec_of(variant: Variant) -> Any:
    from kernels.cuda._spec import AttentionSpec

    v = variant
    if v.kind not in ("decode", "split", "prefill"):
        return None
    return AttentionSpec(v.head_dim, v.block_size, v.num_kv_heads, v.group, v.dtype, v.dtype,
                         v.dtype, v.kind)


def check(report: Report) -> list[str]:
    """Budget violations of the production build: spills, launchability, narrow K/V loads;
    the decode benchmark's register and instruction targets; the prefill benchmark's query
    tile and occupancy."""
    problems = []
    regs = report.production_registers
    if report.spill_bytes:
        problems.append(f"spills {report.spill_bytes} bytes")
    if report.stack_bytes:
        problems.append(f"{report.stack_bytes} bytes of local memory (arrays not in registers)")
    if regs * report.threads > SM90_REGS or report.blocks_per_sm < 1:
        problems.append(f"cannot launch: {regs} registers x {report.threads} threads")
    narrow = {w: n for w, n in report.kv_load_widths.items() if w in ("8-bit", "16-bit", "32-bit")}
    if report.kv_bytes_per_trip and (narrow or not report.kv_load_widths):
        problems.append(f"K/V loads narrower than 8 bytes: {narrow or 'none tagged'}")
    problems.extend(n for n in report.notes if "lower bound" not in n)
    if report.name == DECODE_BENCH:
        if regs > BENCH_MAX_REGS:
            problems.append(f"{regs} registers ({report.toolchain}) > {BENCH_MAX_REGS}")
        if report.instr_per_16b is None or report.instr_per_16b > BENCH_MAX_INSTR_PER_16B:
            problems.append(f"{report.instr_per_16b} instructions per 16 B > "
                            f"{BENCH_MAX_INSTR_PER_16B}")
    if report.name == PREFILL_BENCH:
        rows = report.query_rows_per_cta or 0
        if rows < PREFILL_MIN_ROWS:
            problems.append(f"{rows} query rows per block < {PREFILL_MIN_ROWS}")
        if report.blocks_per_sm < PREFILL_MIN_BLOCKS:
            problems.append(f"{report.blocks_per_sm} blocks/SM < {PREFILL_MIN_BLOCKS}")
        if report.instr_per_16b is None:
            problems.append("no instructions per 16 B for the prefill loop")
        if report.instr_per_hmma is None or report.instr_per_hmma > PREFILL_MAX_INSTR_PER_HMMA:
            problems.append(f"{report.instr_per_hmma} instructions per HMMA in the tile loop > "
                            f"{PREFILL_MAX_INSTR_PER_HMMA}")
    return problems


def table(reports: list[Report]) -> str:
    header = ("| variant | regs ptxas / nvJitLink | spill B | smem B | threads | rows/CTA | "
              "blocks/SM ptxas / nvJitLink | global loads | K/V loads | loop instr | "
              "K/V B/trip/thread | instr / 16 B ptxas / nvJitLink | instr / HMMA (no rescale) | "
              "FMUL / HMMA (no rescale) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    # ">=": the step loop keeps an inner loop, so its static count is a lower bound
    for r in reports:
        bound = ">=" if any("lower bound" in n for n in r.notes) else ""
        widths = ", ".join(f"{n}x{w}" for w, n in sorted(r.load_widths.items()))
        kv = ", ".join(f"{n}x{w}" for w, n in sorted(r.kv_load_widths.items())) or "-"
        jit = r.toolchain == "nvjitlink"
        regs = f"{r.registers} / {r.registers_nvjitlink if jit else '-'}"
        blocks = f"{r.blocks_per_sm_ptxas} / {r.blocks_per_sm if jit else '-'}"
        per_16b = (f"{bound}{r.instr_per_16b_ptxas or '-'} / "
                   f"{(bound + str(r.instr_per_16b or '-')) if jit else '-'}")
        lines.append(f"| {r.name} | {regs} | {r.spill_bytes} | {r.shared_bytes} | "
                     f"{r.threads} | {r.query_rows_per_cta or '-'} | {blocks} | {widths} | {kv} | "
                     f"{r.loop_instructions or '-'} | {r.kv_bytes_per_trip or '-'} | {per_16b} | "
                     f"{_pair(r.instr_per_hmma, r.instr_per_hmma_skip)} | "
                     f"{_pair(r.fmul_per_hmma, r.fmul_per_hmma_skip)} |")
    return "\n".join(lines)


def _pair(every: float | None, skip: float | None) -> str:
    """'x' or 'x (y)' when skipping the rescale changes it."""
    if every is None:
        return "-"
    return f"{every}" if skip in (None, every) else f"{every} ({skip})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the reports as JSON here")
    p.add_argument("--quick", action="store_true", help="one variant per axis value")
    p.add_argument("--only", help="variants whose name contains this string")
    args = p.parse_args(argv)
    ptxas, nvdisasm = find_tool("ptxas"), find_tool("nvdisasm")
    if not ptxas:
        print("kernel_sass: ptxas not found (PATH, $PTXAS, /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    if not nvdisasm:
        print("kernel_sass: nvdisasm not found: SASS metrics omitted", file=sys.stderr)
    jitlink = nvjitlink_version()
    print(f"kernel_sass: ptxas {ptxas_version(ptxas)} (PTX ISA), nvJitLink "
          f"{jitlink or 'not installed (pip install nvidia-nvjitlink): ptxas figures only'}",
          file=sys.stderr)
    variants = [v for v in catalog(args.quick) if not args.only or args.only in v.name]
    reports, failures = [], []
    for v in variants:
        report = analyze(v, ptxas, nvdisasm)
        reports.append(report)
        problems = check(report)
        if problems:
            failures.append(f"{v.name}: {'; '.join(problems)}")
        print(f"{v.name}: {report.registers} regs ptxas, {report.registers_nvjitlink} regs "
              f"nvJitLink, {report.spill_bytes} B spill, {report.blocks_per_sm} blocks/SM, "
              f"{report.instr_per_16b} instr/16 B, {report.instr_per_hmma} instr/HMMA", flush=True)
    print()
    print(table(reports))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2))  # every field
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
