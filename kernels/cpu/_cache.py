"""Numba's on-disk cache for the CPU kernels, invalidated by any source file of the package.

Numba's `cache=True` stamps a cached kernel with its *own* file only: editing a helper in
`_tile.py` would leave `decode.py`'s cached machine code (with the old helper inlined) in use.
`njit_cached` installs the cache `cache=True` would, with one difference: the stamp also
carries a digest of every `*.py` file in the kernel's directory. When any of them changes, the
stamp no longer matches, Numba treats the index as stale, recompiles and overwrites it — the
same path it takes when the kernel's own file changes. Nothing is deleted, and nothing happens
at import beyond reading the sources once to compute the digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from numba import njit
from numba.core.caching import (
    CompileResultCacheImpl,
    FunctionCache,
    InTreeCacheLocator,
    UserProvidedCacheLocator,
    UserWideCacheLocator,
    _SourceFileBackedLocatorMixin,
)


def package_digest(directory: Path) -> str:
    """SHA-256 over the names and contents of the directory's `*.py` files (memoised per
    file-set state: names, sizes and modification times)."""
    files = sorted(directory.glob("*.py"))
    state = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _digest(str(directory), state)


@lru_cache(maxsize=16)
def _digest(directory: str, state: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in state:
        digest.update(name.encode())
        digest.update((Path(directory) / name).read_bytes())
    return digest.hexdigest()


class _PackageStamp(_SourceFileBackedLocatorMixin):
    """Locator mixin: the source stamp also covers the kernel's sibling source files.

    Placed before one of Numba's locators (`_UserProvided` below), all three of which take
    their stamp (the source file's mtime and size) from `_SourceFileBackedLocatorMixin`: this
    class derives from that mixin, so `super().get_source_stamp()` is its stamp, to the type
    checker as at run time (the method order is unchanged: the mixin comes after every
    locator that derives from it)."""

    _py_file: str

    def get_source_stamp(self) -> Any:
        own = super().get_source_stamp()
        return own, package_digest(Path(self._py_file).resolve().parent)


class _UserProvided(_PackageStamp, UserProvidedCacheLocator):
    pass


class _InTree(_PackageStamp, InTreeCacheLocator):
    pass


class _UserWide(_PackageStamp, UserWideCacheLocator):
    pass


class _PackageCacheImpl(CompileResultCacheImpl):
    # Same order as Numba's own: NUMBA_CACHE_DIR, then __pycache__ beside the source, then the
    # user-wide cache directory when the source tree is read-only.
    _locator_classes = [_UserProvided, _InTree, _UserWide]


class PackageFunctionCache(FunctionCache):
    _impl_class = _PackageCacheImpl


def njit_cached(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`numba.njit(**options, cache=True)`, with the package-wide stamp described above."""

    def decorate(fn: Callable[..., Any]) -> Any:
        dispatcher = njit(**options)(fn)
        # What `cache=True` does (Dispatcher.enable_caching), with our cache class.
        dispatcher._cache = PackageFunctionCache(dispatcher.py_func)
        return dispatcher

    return decorate
