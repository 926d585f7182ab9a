"""The committed stubs under pagedkv/v1 must be exactly what `python -m tools.codegen`
produces from the protos; otherwise someone edited a .proto without regenerating."""

from __future__ import annotations

from pathlib import Path

from tools import codegen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = codegen.generate(out_root=tmp_path)
    committed = codegen.generated_files(codegen.REPO_ROOT)
    assert [p.name for p in fresh] == [p.name for p in committed], (
        "generated file set differs; run python -m tools.codegen"
    )
    stale = [c.name for f, c in zip(fresh, committed, strict=True) if f.read_bytes() != c.read_bytes()]
    assert not stale, f"stale generated stubs {stale}; run python -m tools.codegen"


def test_every_proto_has_stubs() -> None:
    names = {p.name for p in codegen.generated_files(codegen.REPO_ROOT)}
    for proto in codegen.proto_files():
        stem = proto.stem
        for suffix in codegen.GENERATED_SUFFIXES:
            assert f"{stem}{suffix}" in names


def test_generated_imports_are_absolute() -> None:
    from pagedkv.v1 import block_manager_pb2, block_manager_pb2_grpc

    assert block_manager_pb2.DESCRIPTOR.package == "pagedkv.v1"
    assert hasattr(block_manager_pb2_grpc, "BlockManagerStub")
    assert hasattr(block_manager_pb2_grpc, "BlockManagerAdminStub")
