"""Unit tests of the compute node's small parts: config, wire encoding, table cache, pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from compute_node.pool import KvPool, PoolGeometry, blocks_for_budget
from compute_node.service.config import ConfigError, load_config
from compute_node.tables import CachedTable, SeqId, TableCache
from compute_node.wire import WireError, decode_tensor, encode_tensor, tensor_to_numpy
from pagedkv.v1 import compute_node_pb2 as pb


# ---- config -------------------------------------------------------------------------------
def test_config_precedence_yaml_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "cn.yaml"
    cfg_file.write_text("node_id: from-yaml\nnum_blocks: 32\ngeometry:\n  num_layers: 3\n  head_dim: 16\n")
    monkeypatch.setenv("PAGEDKV_CN_GEOMETRY__NUM_LAYERS", "5")
    cfg = load_config(cfg_file, listen_address="127.0.0.1:0")
    assert (cfg.node_id, cfg.num_blocks, cfg.geometry.num_layers, cfg.geometry.head_dim) == ("from-yaml", 32, 5, 16)
    assert cfg.block_size is None                       # the block manager's default applies


def test_config_defaults_and_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config().num_blocks == 1024
    cfg = load_config(memory_budget_bytes=1 << 20, block_size=16)
    g = cfg.geometry
    per_block = 2 * g.num_layers * g.num_kv_heads * g.head_dim * 16 * 2
    assert cfg.num_blocks is None
    assert blocks_for_budget(1 << 20, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                             dtype=g.dtype, block_size=16) == (1 << 20) // per_block


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_blocks": 8, "memory_budget_bytes": 1 << 20},
        {"memory_budget_bytes": 1 << 20},                 # budget without a block size
        {"memory_budget_bytes": 10, "block_size": 16},    # below one block
        {"node_id": "bad id!"},
        {"device": "tpu"},
        {"geometry": {"dtype": "int8"}},
        {"unknown_knob": 1},
    ],
)
def test_config_errors(overrides: dict) -> None:
    with pytest.raises(ConfigError):
        load_config(**overrides)


def test_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.yaml")


# ---- wire ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_wire_round_trip(dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, 5).to(dtype)
    msg = encode_tensor(x)
    assert list(msg.shape) == [3, 4, 5] and len(msg.data) == x.numel() * x.element_size()
    assert torch.equal(decode_tensor(msg, "x"), x)
    np.testing.assert_array_equal(tensor_to_numpy(msg), x.float().numpy())


def test_wire_numpy_and_errors() -> None:
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    assert torch.equal(decode_tensor(encode_tensor(a), "a"), torch.from_numpy(a))
    with pytest.raises(WireError):
        encode_tensor(np.arange(3, dtype=np.int64))
    with pytest.raises(WireError):
        decode_tensor(pb.Tensor(dtype="float32", shape=[2], data=b"\x00" * 4), "short")
    with pytest.raises(WireError):
        decode_tensor(pb.Tensor(dtype="float64", shape=[1], data=b"\x00" * 8), "f64")


# ---- table cache --------------------------------------------------------------------------
def test_table_cache_versions_lru_and_suspects() -> None:
    cache = TableCache(capacity=2)
    a, b, c = SeqId("a"), SeqId("b"), SeqId("c")
    cache.put(CachedTable(a, (1, 2), 3))
    assert cache.is_fresh(a, 3) and cache.is_fresh(a, 2) and not cache.is_fresh(a, 4)
    cache.put(CachedTable(a, (9,), 2))                 # older than cached: ignored
    assert cache.get(a).block_table == (1, 2)
    cache.put(CachedTable(b, (5,), 1))
    cache.mark_all_suspect()
    assert not cache.is_fresh(a, 1) and cache.known_version(a) == 3
    cache.confirm(a)
    assert cache.is_fresh(a, 3) and not cache.is_fresh(b, 1)
    cache.get(a)                                       # a most recently used
    cache.put(CachedTable(c, (6,), 1))                 # evicts b
    assert cache.get(b) is None and len(cache) == 2
    cache.drop([a])
    assert cache.get(a) is None


# ---- pool ---------------------------------------------------------------------------------
def test_pool_write_copy_read_back() -> None:
    g = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4, num_blocks=6)
    pool = KvPool(g, torch.device("cpu"))
    assert g.num_bytes == sum(t.numel() * t.element_size() for t in pool.key_caches + pool.value_caches)
    k = torch.randn(3, 2, 8).half()
    v = torch.randn(3, 2, 8).half()
    pool.write(1, k, v, torch.tensor([4, 5, 6]))
    pool.copy_blocks([(1, 3)])                          # block 1 (slots 4..7) -> block 3
    rk, rv = pool.read_tokens(1, [12, 13, 14])
    np.testing.assert_array_equal(rk, k.float().numpy())
    np.testing.assert_array_equal(rv, v.float().numpy())
    assert not pool.key_caches[0].any()                 # layer 0 untouched by the write
