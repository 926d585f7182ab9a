"""Compiled CUDA kernels kept on disk, one entry per kernel variant: a second process skips JIT.

Why: every kernel variant is compiled at its first use in each process — Numba typing and
lowering of the device functions, NVVM to PTX, nvJitLink to a cubin. Measured offline for
sm_90a, one fresh process per variant on a busy 2-core VM: decode 18 s, split-K 22 s, prefill
20 s, reduce 3.7 s, slot write 2.4 s, block copy 2.0 s (`python -m kernels.cuda._kernel_cache`
builds and times all six of a geometry); a model needs all six per dtype and geometry. The README
examples did not finish in 200 s on the first GPU host; per-process JIT is the first suspect
(issue 43). A cached entry loads in 10 ms or less.

Why not Numba's own `cache=True`: its index is keyed by the kernel function's own source
file, and our kernel bodies live in other files (`_tc_attend.py`, `_ops_gpu.py`, ...):
editing one of those would serve a stale kernel. Here the key is the variant (every value the
kernel factory was built from), the signature, the launch bounds and jit options, the
target's compute capability, the Python/Numba/numba-cuda versions and a hash of every source
file under `kernels/cuda/`. What is stored is what Numba's cache stores for a CUDA kernel
(the compiled kernel's reduced state: PTX and cubin per architecture), and it is rebuilt the
same way.

Where: `$PAGEDKV_KERNEL_CACHE` (a directory; `off` disables), else
`$XDG_CACHE_HOME/pagedkv/cuda-kernels` (default `~/.cache/...`). Entries are pickles, written
whole (temporary file, then rename), trusted like `__pycache__`: keep the directory private.

The same entry can be built without a GPU (`build_offline`, the static gate's compile path
for sm_90a): a GPU host started from a prepared directory skips JIT from its first process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sys
import time
import types as pytypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kernels.cuda._runtime import SIMULATOR, jit_options

CACHE_ENV = "PAGEDKV_KERNEL_CACHE"
KERNEL_DIR = Path(__file__).resolve().parent
stats = {"hits": 0, "misses": 0}  # this process's lookups (tests, start-up reports)


def cache_dir() -> Path | None:
    """The cache directory, or None when caching is off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv" / "cuda-kernels"


@functools.cache
def sources_digest() -> str:
    """Hash of every kernel source file: any edit under kernels/cuda/ invalidates entries."""
    digest = hashlib.sha256()
    for source in sorted(KERNEL_DIR.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def _versions() -> tuple[str, ...]:
    from importlib.metadata import version

    import numba

    return (sys.version.split()[0], numba.__version__, version("numba-cuda"))


def target_cc(cc: tuple[int, int]) -> tuple[int, int, str]:
    """The architecture numba-cuda builds for a device of compute capability `cc`
    (`sm_90a` on Hopper: arch-specific features on)."""
    return (cc[0], cc[1], "a" if cc >= (9, 0) else "")


def entry_key(variant: str, signature: tuple[Any, ...], targetoptions: dict[str, Any],
              cc: tuple[int, int, str]) -> str:
    """The file name of one compiled kernel (a hash of everything that shapes its code)."""
    options = sorted((k, repr(v)) for k, v in targetoptions.items())
    text = repr((variant, [str(t) for t in signature], options, cc, _versions(),
                 sources_digest()))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _load(path: Path) -> Any | None:
    """The kernel stored at `path`, or None (absent, or unreadable: compiled anew)."""
    from numba.cuda.dispatcher import _Kernel

    try:
        payload = pickle.loads(path.read_bytes())
        return _Kernel._rebuild(**payload)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign entry is just a miss
        print(f"pagedkv: ignoring kernel cache entry {path.name}: {exc!r}", file=sys.stderr)
        return None


def _save(path: Path, kernel: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps(kernel._reduce_states(), protocol=pickle.HIGHEST_PROTOCOL))
    tmp.replace(path)  # whole or absent, also with another process writing the same entry


def _argtypes(signature: tuple[Any, ...]) -> tuple[Any, ...]:
    from numba.core import sigutils

    argtypes, _ = sigutils.normalize_signature(signature)
    return tuple(argtypes)


def compile_kernel(pyfunc: Any, signature: tuple[Any, ...],
                   launch_bounds: tuple[int, ...] | None, variant: str) -> Any:
    """`cuda.jit(signature, **jit_options(launch_bounds))(pyfunc)` — the same specialised
    dispatcher — with its compiled kernel loaded from the disk cache when present and saved
    to it after a compile. `variant` names everything the factory built `pyfunc` from
    (e.g. the `AttentionSpec`): two different kernels must never share one."""
    from numba import cuda

    directory = cache_dir()
    if SIMULATOR or directory is None:
        return cuda.jit(signature, **jit_options(launch_bounds))(pyfunc)
    from numba.cuda import dispatcher as numba_dispatcher

    dispatcher = cuda.jit(**jit_options(launch_bounds))(pyfunc)  # lazy: nothing compiled yet
    # the device numba-cuda compiles for (the module attribute `offline_target` answers)
    cc = target_cc(numba_dispatcher.get_current_device().compute_capability)
    path = directory / f"{entry_key(variant, signature, dispatcher.targetoptions, cc)}.nbk"
    kernel = _load(path)
    if kernel is None:
        stats["misses"] += 1
        kernel = dispatcher.compile(signature)  # Numba's own path: compile, link, load
        with contextlib.suppress(OSError):  # a read-only cache directory: still runs
            _save(path, kernel)
    else:
        stats["hits"] += 1
        dispatcher.add_overload(kernel, _argtypes(signature))
    # What cuda.jit(signature) does after compiling: one overload, launched without typing
    # the arguments, and no further compilation.
    dispatcher._specialized = True
    dispatcher.disable_compile()
    return dispatcher


@contextlib.contextmanager
def offline_target(cc: tuple[int, int]) -> Iterator[None]:
    """Let numba-cuda compile and link for `cc` with no GPU or driver: the two places it asks
    the current device for its compute capability answer `cc` (the static gate does the same,
    `bench/kernel_sass.py`)."""
    from numba.cuda import codegen, dispatcher

    device = pytypes.SimpleNamespace(compute_capability=cc)
    saved = dispatcher.get_current_device, codegen.devices.get_context
    dispatcher.get_current_device = lambda: device
    codegen.devices.get_context = lambda: pytypes.SimpleNamespace(device=device)
    try:
        yield
    finally:
        dispatcher.get_current_device, codegen.devices.get_context = saved


def build_offline(pyfunc: Any, signature: tuple[Any, ...],
                  launch_bounds: tuple[int, ...] | None, variant: str,
                  cc: tuple[int, int] = (9, 0)) -> tuple[bool, float]:
    """Compile one variant for `cc` without a GPU into the cache entry `compile_kernel` loads
    on such a device: (hit, seconds). A hit only reads the entry."""
    from numba import cuda
    from numba.cuda.dispatcher import _Kernel

    directory = cache_dir()
    if directory is None:
        raise RuntimeError(f"the kernel cache is off (${CACHE_ENV})")
    start = time.perf_counter()
    with offline_target(cc):
        dispatcher = cuda.jit(**jit_options(launch_bounds))(pyfunc)
        arch = target_cc(cc)
        path = directory / f"{entry_key(variant, signature, dispatcher.targetoptions, arch)}.nbk"
        if _load(path) is not None:
            stats["hits"] += 1
            return True, time.perf_counter() - start
        stats["misses"] += 1
        kernel = _Kernel(pyfunc, _argtypes(signature), **dispatcher.targetoptions)
        kernel._codelibrary.get_cubin(cc=arch)  # what bind() would link on the device
        _save(path, kernel)
    return False, time.perf_counter() - start


def decode_variants(head_dim: int, block_size: int, num_kv_heads: int, group: int,
                    kind: str) -> list[tuple[str, Any, tuple[Any, ...], tuple[int, ...] | None]]:
    """(variant, kernel function, signature, launch bounds) of the decode family of one
    geometry, named as `decode.py`, `decode_split.py` and `decode_reduce.py` cache them."""
    from kernels.cuda import decode, decode_reduce, decode_split
    from kernels.cuda._host import launch_bounds, spec_for

    spec = spec_for(head_dim, block_size, num_kv_heads, group, kind, kind, kind, "decode")
    split = decode.split_spec(spec)
    heads = spec.num_heads
    return [
        (f"decode {spec!r}", decode.build_decode_kernel(spec), decode.DECODE_SIGNATURE,
         launch_bounds(spec)),
        (f"split {split!r}", decode_split.build_split_kernel(split), decode_split.SPLIT_SIGNATURE,
         launch_bounds(split)),
        (f"reduce {head_dim} {heads} {kind}", decode_reduce.build_reduce_kernel(head_dim, heads, kind),
         decode_reduce.REDUCE_SIGNATURE, (decode_reduce.THREADS, 1)),
    ]


def geometry_variants(head_dim: int, block_size: int, num_kv_heads: int, group: int,
                      kind: str) -> list[tuple[str, Any, tuple[Any, ...], tuple[int, ...] | None]]:
    """Every kernel a model of one geometry launches, named as their entry points cache them:
    the decode family, slot write, block copy and prefill (`prefill_launch_bounds`)."""
    from kernels.cuda import block_copy, prefill, slot_write
    from kernels.cuda._host import spec_for

    spec = spec_for(head_dim, block_size, num_kv_heads, group, kind, kind, kind, "prefill")
    cache_shape = f"{num_kv_heads} {block_size} {head_dim} {kind}"
    return [
        *decode_variants(head_dim, block_size, num_kv_heads, group, kind),
        (f"write {cache_shape}", slot_write.build_write_kernel(num_kv_heads, block_size, head_dim, kind),
         slot_write.WRITE_SIGNATURE, (slot_write.THREADS, 1)),
        (f"copy {cache_shape}", block_copy.build_copy_kernel(num_kv_heads, block_size, head_dim, kind),
         block_copy.COPY_SIGNATURE, (block_copy.THREADS, 1)),
        (f"prefill {spec!r}", prefill.build_prefill_kernel(spec), prefill.PREFILL_SIGNATURE,
         prefill.prefill_launch_bounds(spec)),
    ]


def main(argv: list[str] | None = None) -> int:
    """Build a geometry's kernels (decode, split-K, reduce, slot write, block copy, prefill)
    for sm_90a into the cache, without a GPU, and print the seconds each took (a miss
    compiles, a hit reads the entry)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--dtype", choices=("f16", "bf16", "f32"), default="f16")
    args = parser.parse_args(argv)
    total = 0.0
    for variant, pyfunc, signature, bounds in geometry_variants(
            args.head_dim, args.block_size, args.kv_heads, args.group, args.dtype):
        hit, seconds = build_offline(pyfunc, signature, bounds, variant)
        total += seconds
        print(f"{'hit ' if hit else 'miss'} {seconds:7.2f} s  {variant}", flush=True)
    print(f"total {total:.2f} s in {cache_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
