"""Where a side's time goes: py-spy samples (raw format, `bench_vs_vllm.py --profile DIR`) sorted
into dense layers, attention, fused elementwise work, the LM head and sampler, the engine's own
Python, and waiting (issue 42: "say for each workload where the remaining time goes on both
sides").

A sample is classified by its innermost *meaningful* Python frame: torch's dispatch frames
(`torch/_ops.py`, `nn/modules/module.py`, decorators) are skipped, so a matmul is charged to the
`linear` that called it, not to `OpOverload.__call__`. vLLM's compiled mode runs the whole
forward as one Inductor-generated `Runner.call`; there the generated source line is read (the
file is found by name under `--source-roots`) and classified by the call it makes
(`cpp_fused_*` = fused elementwise kernels, `mkldnn`/`mm` = dense, `attention` = attention).

Samples inside a JIT compiler (Numba, Inductor) are their own row: a compile while the clock
runs is a first use the warm-up missed, not a cost of the step. Numbers are shares of the
samples of each process (py-spy records only threads that are not
idle, so a busy-polling thread counts as busy: that is the point of the `waiting` row).

    .venv/bin/python bench/profile_split.py DIR [--source-roots ~/.cache/vllm]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

CATEGORIES = ("dense", "attention", "elementwise", "lm head + sampler", "engine + other", "waiting", "JIT compile")

# Frames that only dispatch: skipped when looking for the frame that says what the work is.
_GENERIC = re.compile(
    r"torch/_ops\.py|torch/nn/modules/module\.py|_contextlib\.py|torch/_compile\.py|eval_frame\.py"
    r"|torch/_dynamo/|torch/_inductor/(?!.*output_code)|^\s*0x[0-9a-f]+ |\(\?\)$|\.so[.\d]*\)$|^thread |^process "
    # native helpers (vector intrinsics, atomics, refcounts, the STL): the caller says what it is
    r"|avxintrin\.h|avx512\w*\.h|vec256|vec512|Vectorized|vec_op::|cpu_types_x86|atomic_base\.h|stl_\w+\.h"
    r"|object\.h|intrusive_ptr|\bPy_[A-Z]|omppool\.cpp|gufunc_scheduler|workqueue\.c|new_allocator\.h|alloc_traits\.h")
# First match wins, in this order (waiting before the rest: a poll inside a step is waiting).
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("waiting", re.compile(r"sched_yield|Condition\.wait|Event\.wait|\bpoll\b|Poller\.poll|select\b|_recv\b"
                           r"|epoll|recv_multipart|memory_fence|acquire_read|Queue\.get|SimpleQueue_get"
                           r"|\bsleep\b|busy_loop|wait_for", re.I)),
    ("lm head + sampler", re.compile(r"sampl|logits|lm_head|argmax|\btopk\b|top_k|logprob", re.I)),
    ("attention", re.compile(r"attention|attn|cpu_attn|paged|sdpa|kv_cache_update|reshape_and_cache|write_slots"
                             r"|StepAttention|Prefill", re.I)),
    ("elementwise", re.compile(r"rms_norm|rmsnorm|add_norm|layernorm|layer_norm|\brope|rotary|silu|act_and_mul"
                               r"|activation|gelu|cpp_fused", re.I)),
    ("dense", re.compile(r"linear|gemm|matmul|\bmm\b|addmm|mkldnn|dnnl|onednn|_dense|f32_view|rows_f32"
                         r"|ParallelLinear|extern_kernels", re.I)),
)
_LM_HEAD = re.compile(r"\.logits \(|compute_logits|sample_tokens|\._sample \(|Sampler\.|sample_greedy"
                      r"|prompt_scores|_score_rows")
# A kernel compiled while the clock runs (a first use the warm-up did not cover): Numba or Inductor.
_COMPILE = re.compile(r"numba/core/compiler(_lock|_machinery)?\.py|llvmlite/binding/|torch/_inductor/compile_fx\.py")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+):(?P<line>\d+)\)$")
# An Inductor output module: named by the hash of its code.
_INDUCTOR_FILE = re.compile(r"^c[a-z0-9]{40,}\.py$")
# Inductor's generated C++ (`cpp_fused_*` kernels compiled per graph): fused elementwise work.
_INDUCTOR_CPP = re.compile(r"\(c[a-z0-9]{40,}\.main\.cpp:\d+\)$")


class SourceLines:
    """Lines of Inductor's generated modules, found by file name under the given roots."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self._files: dict[str, list[str] | None] = {}

    def line(self, name: str, lineno: int) -> str | None:
        if name not in self._files:
            found = next((p for r in self.roots if r.is_dir() for p in r.rglob(name)), None)
            self._files[name] = found.read_text(errors="replace").splitlines() if found else None
        lines = self._files[name]
        return lines[lineno - 1] if lines and 0 < lineno <= len(lines) else None


def classify(frames: list[str], sources: SourceLines | None = None) -> str:
    """The category of one sample: its innermost frame that is not dispatch machinery; work
    under the logits / sampling step (the LM head's matmul included) is the LM head's."""
    if any(_COMPILE.search(f) for f in frames):
        return "JIT compile"
    kind = _innermost(frames, sources)
    if kind != "waiting" and any(_LM_HEAD.search(f) for f in frames):
        return "lm head + sampler"
    return kind


def _innermost(frames: list[str], sources: SourceLines | None) -> str:
    for frame in reversed(frames):
        if _GENERIC.search(frame):
            continue
        if _INDUCTOR_CPP.search(frame):
            return "elementwise"
        text = frame
        m = _FRAME.match(frame)
        if m and sources is not None and _INDUCTOR_FILE.match(Path(m["file"]).name):
            text = sources.line(Path(m["file"]).name, int(m["line"])) or frame
        for name, rule in _RULES:
            if rule.search(text):
                return name
        if m and _INDUCTOR_FILE.match(Path(m["file"]).name):
            continue   # glue in the generated module (buffer views, asserts): look at its caller
        if m:
            return "engine + other"
    return "engine + other"


def split(path: Path, sources: SourceLines | None = None) -> dict[str, Counter[str]]:
    """Samples per category, per process (the first frame of py-spy's --subprocesses output)."""
    out: dict[str, Counter[str]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # --subprocesses nests a child under its parent: the innermost `process` frame names it
        procs = [f for f in frames if f.startswith("process ")]
        cmd = procs[-1].split(":", 1)[-1].strip('"') if procs else ""
        proc = cmd.split()[0] if cmd.startswith("VLLM::") else "main"
        out.setdefault(proc, Counter())[classify(frames, sources)] += int(count)
    return out


def table(results: dict[str, dict[str, Counter[str]]]) -> str:
    rows = ["| profile | process | samples | " + " | ".join(CATEGORIES) + " |",
            "|---|---|---|" + "---|" * len(CATEGORIES)]
    for name, procs in results.items():
        for proc, counts in sorted(procs.items()):
            total = sum(counts.values())
            if total == 0:
                continue
            cells = [f"{100 * counts[c] / total:.0f}%" for c in CATEGORIES]
            rows.append(f"| {name} | {proc} | {total} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def start_profile(py_spy: str, pid: int, out: Path, rate: int = 50) -> subprocess.Popen:
    """py-spy sampling process `pid` and its children (vLLM's engine core and worker) with
    native frames, into `out` (raw format), until `stop_profile`. Sampling stops the process
    for each native unwind: a profiled run gives the split, not the tok/s."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--subprocesses", "--native", "--rate", str(rate),
                             "--threads", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)   # attached before the clock starts
    return proc


def stop_profile(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)   # py-spy writes its file on SIGINT
    proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a --profile directory (searched recursively for *.txt)")
    p.add_argument("--source-roots", default=str(Path.home() / ".cache" / "vllm") + ",/tmp",
                   help="where Inductor's generated modules are (comma-separated)")
    args = p.parse_args(argv)
    sources = SourceLines([Path(r).expanduser() for r in args.source_roots.split(",") if r])
    files = sorted(args.dir.rglob("*.txt"))
    if not files:
        p.error(f"no py-spy profiles (*.txt) under {args.dir}")
    print(table({str(f.relative_to(args.dir)): split(f, sources) for f in files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
