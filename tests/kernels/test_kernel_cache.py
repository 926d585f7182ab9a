"""The on-disk cache of compiled CUDA kernels (issue 43 item 4: JIT time per variant).

No GPU here: one process builds a variant for sm_90a the offline way (NVVM, nvJitLink) into
a fresh cache directory; a second process must find it without compiling anything (NVVM
made to fail there), both through `build_offline` and through the production entry points
(`decode_reduce.reduce_kernel`, `slot_write.write_kernel`, `block_copy.copy_kernel`,
`prefill.prefill_kernel` with its launch bounds: what a GPU process calls at first use).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if sys.platform != "linux" or importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("compiling kernels offline needs NVVM and nvJitLink (Linux wheels)", allow_module_level=True)

from kernels.cuda import _kernel_cache  # noqa: E402
from kernels.cuda._kernel_cache import CACHE_ENV, cache_dir, entry_key, target_cc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Each kernel the cache serves: (variant as its production entry point names it, kernel function,
# signature, launch bounds, the production entry point's call). Decode and split-K are left out
# here for time (~20 s each to compile); `python -m kernels.cuda._kernel_cache` builds those.
KERNELS = textwrap.dedent("""
    from kernels.cuda import block_copy, decode_reduce, prefill, slot_write
    from kernels.cuda._host import spec_for
    PREFILL = spec_for(64, 16, 2, 4, "f16", "f16", "f16", "prefill")
    KERNELS = {
        "reduce": ("reduce 64 8 f16", lambda: decode_reduce.build_reduce_kernel(64, 8, "f16"),
                   decode_reduce.REDUCE_SIGNATURE, (decode_reduce.THREADS, 1),
                   lambda: decode_reduce.reduce_kernel(64, 8, "f16")),
        "write": ("write 2 16 64 f16", lambda: slot_write.build_write_kernel(2, 16, 64, "f16"),
                  slot_write.WRITE_SIGNATURE, (slot_write.THREADS, 1),
                  lambda: slot_write.write_kernel(2, 16, 64, "f16")),
        "copy": ("copy 2 16 64 f16", lambda: block_copy.build_copy_kernel(2, 16, 64, "f16"),
                 block_copy.COPY_SIGNATURE, (block_copy.THREADS, 1),
                 lambda: block_copy.copy_kernel(2, 16, 64, "f16")),
        "prefill": (f"prefill {PREFILL!r}", lambda: prefill.build_prefill_kernel(PREFILL),
                    prefill.PREFILL_SIGNATURE, prefill.prefill_launch_bounds(PREFILL),
                    lambda: prefill.prefill_kernel(PREFILL)),
    }
""")

BUILD = KERNELS + textwrap.dedent("""
    import json, sys
    from kernels.cuda import _kernel_cache as kc
    stage, name = sys.argv[1], sys.argv[2]
    if stage == "second":  # nothing may compile in this process
        from numba.cuda.cudadrv import nvvm
        def refuse(*args, **kwargs):
            raise RuntimeError("NVVM called: the cache was missed")
        nvvm.compile_ir = refuse
    variant, build, signature, bounds, production = KERNELS[name]
    hit, seconds = kc.build_offline(build(), signature, bounds, variant)
    result = {"offline_hit": hit, "seconds": seconds}
    if stage == "second":  # the production entry point, on a pretend sm_90 device
        with kc.offline_target((9, 0)):
            kernel = production()
        (compiled,) = kernel.overloads.values()
        result["cubins"] = [list(cc) for cc in compiled._codelibrary._cubin_cache]
    result["stats"] = kc.stats
    print(json.dumps(result))
""")


def _run(stage: str, kernel: str, cache: Path) -> dict:
    import json

    env = dict(os.environ, PYTHONPATH=str(REPO), **{CACHE_ENV: str(cache)})
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-c", BUILD, stage, kernel], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["reduce", "write", "copy", "prefill"])
def test_a_second_process_loads_the_compiled_kernel(kernel: str, tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    first = _run("first", kernel, cache)
    assert first["offline_hit"] is False and first["stats"] == {"hits": 0, "misses": 1}
    assert len(list(cache.glob("*.nbk"))) == 1
    second = _run("second", kernel, cache)
    assert second["offline_hit"] is True
    assert second["stats"] == {"hits": 2, "misses": 0}  # build_offline, then the entry point
    assert second["cubins"] == [[9, 0, "a"]]  # the cubin a Hopper GPU loads, no link needed
    assert second["seconds"] < first["seconds"]


def test_entries_are_keyed_by_everything_that_shapes_the_code(monkeypatch, tmp_path) -> None:
    from numba import types

    sig = (types.int64, types.int32)
    options = {"lineinfo": True, "lto": False, "launch_bounds": (128, 6)}
    base = entry_key("decode spec-a", sig, options, (9, 0, "a"))
    assert base == entry_key("decode spec-a", sig, dict(options), (9, 0, "a"))
    assert base != entry_key("decode spec-b", sig, options, (9, 0, "a"))
    assert base != entry_key("decode spec-a", (types.int64, types.int64), options, (9, 0, "a"))
    assert base != entry_key("decode spec-a", sig, {**options, "launch_bounds": (128, 5)}, (9, 0, "a"))
    assert base != entry_key("decode spec-a", sig, options, (8, 0, ""))
    # any edit of any kernel source file gives new keys
    sources = tmp_path / "cuda"
    sources.mkdir()
    for f in _kernel_cache.KERNEL_DIR.glob("*.py"):
        (sources / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(_kernel_cache, "KERNEL_DIR", sources)
    _kernel_cache.sources_digest.cache_clear()
    try:
        copied = entry_key("decode spec-a", sig, options, (9, 0, "a"))
        (sources / "_tc_attend.py").write_text((sources / "_tc_attend.py").read_text() + "\n# edit\n")
        _kernel_cache.sources_digest.cache_clear()
        assert entry_key("decode spec-a", sig, options, (9, 0, "a")) != copied
    finally:
        _kernel_cache.sources_digest.cache_clear()
    assert target_cc((9, 0)) == (9, 0, "a") and target_cc((8, 9)) == (8, 9, "")


def test_cache_location_and_damaged_entries(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    assert cache_dir() is None
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "pagedkv" / "cuda-kernels"
    damaged = tmp_path / "x.nbk"
    damaged.write_bytes(b"not a pickle")
    assert _kernel_cache._load(damaged) is None  # a miss: compiled anew, then overwritten
    assert _kernel_cache._load(tmp_path / "absent.nbk") is None
