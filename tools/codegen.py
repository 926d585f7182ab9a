"""Regenerate the committed Python stubs from `proto/pagedkv/v1/*.proto`.

    python -m tools.codegen            # rewrite pagedkv/v1/ in the repository
    python -m tools.codegen --out DIR  # write into DIR/pagedkv/v1/ instead (staleness test)

The stubs are committed (so an installed package needs no protoc) and a test regenerates
them into a temporary directory and fails when they differ. Protos are compiled with
`-I proto`, so generated imports are absolute (`from pagedkv.v1 import ...`) and nothing
named `proto` ever becomes importable. mypy-protobuf adds `.pyi` stubs for type checkers.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("pagedkv") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
INIT_TEXT = '"""Generated gRPC/protobuf stubs of the pagedkv v1 protocol (see proto/README.md)."""\n'


class CodegenError(RuntimeError):
    """protoc failed or a plugin is missing."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every v1 proto, sorted so the generator's output order is stable."""
    return sorted((proto_root / PACKAGE_DIR).glob("*.proto"))


def _plugin(name: str) -> str:
    # The mypy-protobuf plugins live next to the interpreter in a virtualenv; fall back
    # to PATH for system installs.
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise CodegenError(f"{name} not found (pip install mypy-protobuf)")
    return found


def generated_files(out_root: Path) -> list[Path]:
    """Generated files (and the package `__init__.py`) under `out_root/pagedkv/v1`."""
    pkg = out_root / PACKAGE_DIR
    return sorted(p for p in pkg.iterdir() if p.name == "__init__.py" or p.name.endswith(GENERATED_SUFFIXES))


def generate(out_root: Path = REPO_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every v1 proto into `out_root/pagedkv/v1/`; returns the files written.

    Stale generated files (of a proto that no longer exists) are removed first so the
    output is exactly a function of the protos.
    """
    from grpc_tools import protoc  # dev dependency: imported only when generating

    protos = proto_files(proto_root)
    if not protos:
        raise CodegenError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    pkg = out_root / PACKAGE_DIR
    pkg.mkdir(parents=True, exist_ok=True)
    for old in pkg.iterdir():
        if old.name.endswith(GENERATED_SUFFIXES):
            old.unlink()
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *(str(p.relative_to(proto_root)) for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise CodegenError(f"protoc failed with exit code {rc}")
    (pkg / "__init__.py").write_text(INIT_TEXT)
    (out_root / "pagedkv" / "__init__.py").touch(exist_ok=True)
    return generated_files(out_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    try:
        written = generate(args.out)
    except CodegenError as exc:
        print(f"codegen: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
