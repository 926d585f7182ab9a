"""The node's disk tier store (compute_node/disk_tier.py): blocks written from the host tier
read back bit-exact with their identity (bf16 too), survive reopening with the same model and
layout, a reused slot serves its new block, and a corrupt slot, a file cut short, or a file of
another model or layout is discarded with a warning and never served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from compute_node.disk_tier import HEADER_BYTES, DiskBlockMeta, DiskKvStore, DiskTierCorrupt, model_identity
from compute_node.host_pool import HostKvPool
from compute_node.pool import PoolGeometry

GEOM = PoolGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, num_blocks=10)


def _host(geom: PoolGeometry = GEOM, seed: int = 0) -> HostKvPool:
    torch.manual_seed(seed)
    host = HostKvPool(geom, 6, torch.device("cpu"))
    for t in (*host.key_caches, *host.value_caches):
        t.copy_(torch.randn(t.shape).to(t.dtype))
    return host


def _meta(i: int, salt: str | None = None) -> DiskBlockMeta:
    return DiskBlockMeta(bytes([i]) * 32, None if i == 0 else bytes([i - 1]) * 32, salt, (i, i + 1, i + 2, i + 3))


def _store(path: Path, geom: PoolGeometry = GEOM, model: str = "m1", slots: int = 5) -> DiskKvStore:
    store_bytes = HEADER_BYTES + slots * _slot_bytes(geom)
    return DiskKvStore(path, store_bytes, geom, model)


def _slot_bytes(geom: PoolGeometry) -> int:
    payload = geom.num_layers * 2 * geom.num_kv_heads * geom.block_size * geom.head_dim * geom.itemsize
    meta = 2 * 32 + 1 + 3 + 4096 + 4 + 4 * geom.block_size
    return -(-(32 + meta + payload) // 4096) * 4096


def _payload_at(store: DiskKvStore, slot: int) -> int:
    return HEADER_BYTES + slot * store.slot_bytes + 32 + store.meta_cap


def _blocks(host: HostKvPool, h: int) -> list[torch.Tensor]:
    return [t[h].clone() for t in (*host.key_caches, *host.value_caches)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_written_blocks_read_back_exactly_with_their_identity(tmp_path: Path, dtype: str) -> None:
    geom = PoolGeometry(3, 2, 8, dtype, 4, 10)
    src, dst = _host(geom, 1), _host(geom, 2)
    store = _store(tmp_path, geom)
    assert store.num_blocks == 5
    store.write(src, [(4, 0, _meta(0, "tenant")), (1, 3, _meta(1))])
    store.read(dst, [(3, 5), (0, 2)])                 # shuffled, into other host blocks
    for a, b in zip(_blocks(src, 4), _blocks(dst, 2)):
        assert torch.equal(a, b)
    for a, b in zip(_blocks(src, 1), _blocks(dst, 5)):
        assert torch.equal(a, b)
    assert {r.slot: r.meta for r in store.records()} == {0: _meta(0, "tenant"), 3: _meta(1)}
    store.close()


def test_a_reopened_store_keeps_its_blocks_and_a_reused_slot_serves_the_new_one(tmp_path: Path) -> None:
    src = _host(seed=3)
    store = _store(tmp_path)
    store.write(src, [(0, 1, _meta(0)), (2, 2, _meta(1))])
    store.write(src, [(5, 1, _meta(7))])              # the block manager reused slot 1 (LRU)
    store.close()
    again = _store(tmp_path)
    recs = {r.slot: r for r in again.records()}
    assert {s: r.meta for s, r in recs.items()} == {1: _meta(7), 2: _meta(1)}
    assert recs[1].last_used > recs[2].last_used       # the LRU order survives
    dst = _host(seed=4)
    again.read(dst, [(1, 0)])
    for a, b in zip(_blocks(src, 5), _blocks(dst, 0)):
        assert torch.equal(a, b)
    assert os.path.getsize(again.file) == HEADER_BYTES + 5 * again.slot_bytes   # bounded
    again.close()


def test_a_corrupt_slot_is_discarded_with_a_warning_the_others_kept(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write(_host(), [(0, 0, _meta(0)), (1, 1, _meta(1))])
    store.close()
    with open(tmp_path / "kv.seg", "r+b") as f:       # flip one payload byte of slot 1
        f.seek(_payload_at(store, 1) + 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with capture_logs() as logs:
        again = _store(tmp_path)
    assert [r.slot for r in again.records()] == [0]
    assert any(e["event"] == "disk_block_discarded" and e["slot"] == 1 and e["log_level"] == "warning" for e in logs)
    with pytest.raises(DiskTierCorrupt):
        again.read(_host(), [(1, 0)])                 # never served
    again.close()
    assert [r.slot for r in _store(tmp_path).records()] == [0]   # the bad slot stays gone


def test_a_slot_altered_while_running_fails_the_read_instead_of_serving_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write(_host(), [(0, 2, _meta(0))])
    os.pwrite(store.fd, b"\x01", _payload_at(store, 2) + store.payload_bytes - 1)
    dst = _host(seed=9)
    before = _blocks(dst, 0)
    with pytest.raises(DiskTierCorrupt):
        store.read(dst, [(2, 0)])
    assert all(torch.equal(a, b) for a, b in zip(before, _blocks(dst, 0)))   # nothing half-written
    assert store.records() == []
    store.close()


def test_a_truncated_file_loses_the_slots_past_its_end(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write(_host(), [(0, 0, _meta(0)), (1, 3, _meta(1))])
    store.close()
    os.truncate(tmp_path / "kv.seg", HEADER_BYTES + 3 * store.slot_bytes + 100)   # cuts slot 3
    with capture_logs() as logs:
        again = _store(tmp_path)
    assert [r.slot for r in again.records()] == [0]
    assert any(e["event"] == "disk_tier_truncated" for e in logs)
    assert os.path.getsize(again.file) == HEADER_BYTES + 5 * again.slot_bytes
    again.close()


@pytest.mark.parametrize("change", ["model", "dtype", "layout", "garbage"])
def test_a_file_of_another_model_or_layout_is_discarded(tmp_path: Path, change: str) -> None:
    store = _store(tmp_path)
    store.write(_host(), [(0, 0, _meta(0))])
    store.close()
    geom, model = GEOM, "m1"
    if change == "model":
        model = "m2"
    elif change == "dtype":
        geom = PoolGeometry(3, 2, 8, "float16", 4, 10)
    elif change == "layout":
        geom = PoolGeometry(3, 1, 8, "float32", 4, 10)
    else:
        with open(tmp_path / "kv.seg", "r+b") as f:
            f.write(b"garbage!")
    with capture_logs() as logs:
        again = _store(tmp_path, geom, model)
    assert again.records() == []
    assert any(e["event"] == "disk_tier_discarded" and e["log_level"] == "warning" for e in logs)
    again.close()


def test_model_identity_follows_the_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 1000)
    first = model_identity(tmp_path)
    assert model_identity(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"a" * 999 + b"b")
    assert model_identity(tmp_path) != first


def test_a_budget_below_one_slot_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no block"):
        DiskKvStore(tmp_path, HEADER_BYTES + 10, GEOM, "m1")


def test_the_node_config_checks_the_disk_tier_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from compute_node.service.config import ComputeNodeConfig, load_config

    with pytest.raises(ValidationError, match="both disk_kv_path and disk_kv_bytes"):
        ComputeNodeConfig(disk_kv_path=str(tmp_path))
    with pytest.raises(ValidationError, match="needs a model"):
        ComputeNodeConfig(disk_kv_path=str(tmp_path), disk_kv_bytes=1 << 20)
    with pytest.raises(ValidationError, match="needs a host tier"):
        ComputeNodeConfig(model=str(tmp_path), disk_kv_path=str(tmp_path), disk_kv_bytes=1 << 20)
    monkeypatch.setenv("PAGEDKV_CN_DISK_KV_PATH", str(tmp_path))
    monkeypatch.setenv("PAGEDKV_CN_DISK_KV_BYTES", str(1 << 30))
    cfg = load_config(model=str(tmp_path), host_kv_blocks=8)
    assert (cfg.disk_kv_path, cfg.disk_kv_bytes) == (str(tmp_path), 1 << 30)


def test_one_slot_file_serves_one_node(tmp_path: Path) -> None:
    from compute_node.disk_tier import DiskTierInUse

    first = _store(tmp_path)
    with pytest.raises(DiskTierInUse, match="in use by another node"):
        _store(tmp_path)
    first.close()
    _store(tmp_path).close()   # free again once the first one closed
