"""Unit tests of the compute node's small parts: config, wire encoding, table cache, pool."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from compute_node.errors import InvalidForward, NodeFenced, StaleStep, StaleTable, UnknownSequence
from compute_node.forward import ForwardBatch, parse_forward, resolve_sequences
from compute_node.pool import KvPool, PoolAllocationError, PoolGeometry, blocks_for_budget
from compute_node.service.config import ConfigError, load_config
from compute_node.tables import NodeTable, SeqId, TableCache, stage
from compute_node.wire import WireError, decode_tensor, encode_tensor, tensor_to_numpy
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1.common_pb2 import PoolStep


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


def test_a_misspelt_device_gets_the_words_llm_and_pagedkv_serve_use() -> None:
    with pytest.raises(ConfigError, match=re.escape("device: expected auto, cpu, cuda or cuda:N, got 'cuda0'")):
        load_config(device="cuda0")
    names = ["auto", "cpu", "cuda", "cuda:1"]
    assert [load_config(device=d).device for d in names] == names


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


# ---- tables: staging the block manager's steps ------------------------------------------
def _pool_step(step_id: int, *, base: int | None = None, epoch: int = 1, **cols: object) -> PoolStep:
    return PoolStep(pool_id="n", epoch=epoch, step_id=step_id,
                    base_step_id=step_id - 1 if base is None else base, **cols)  # type: ignore[arg-type]


def _new_table(sid: str, version: int, blocks: list[int], covered: int = 0) -> dict:
    return dict(delta_seq_ids=[sid], delta_base_versions=[0], delta_versions=[version], delta_num_tokens=[covered],
                delta_num_replaced=[0], delta_num_appended=[len(blocks)], appended_blocks=blocks)


def test_stage_applies_deltas_only_on_commit() -> None:
    cache = TableCache()
    staged = stage(cache, [_pool_step(1, **_new_table("a", 3, [4, 5], covered=4))], "n", 1, 16)
    assert cache.get(SeqId("a")) is None and cache.last_step_id == 0       # staging changes nothing
    cache.commit(staged)
    assert cache.get(SeqId("a")) == NodeTable([4, 5], 3, 4) and cache.last_step_id == 1
    # step 2: replace position 0 (a defrag move), append block 9, copy 5 -> 9 first; drop "gone"
    move = _pool_step(
        2, copy_src=[5], copy_dst=[9], copy_is_defrag=[False], delta_seq_ids=["a"], delta_base_versions=[3],
        delta_versions=[7], delta_num_tokens=[0], delta_num_replaced=[1], replaced_positions=[0],
        replaced_blocks=[1], delta_num_appended=[1], appended_blocks=[9], dropped_seq_ids=["gone"],
    )
    staged = stage(cache, [move], "n", 1, 16)
    assert staged.copy_pairs == [(5, 9)] and staged.table(cache, SeqId("gone")) is None
    cache.commit(staged)
    assert cache.get(SeqId("a")) == NodeTable([1, 5, 9], 7, 4)


@pytest.mark.parametrize(
    ("steps", "error"),
    [
        ([_pool_step(2, **_new_table("b", 1, [0]))], StaleStep),                  # step 1 skipped
        ([_pool_step(1, epoch=2, **_new_table("b", 1, [0]))], NodeFenced),        # a later registration
        ([_pool_step(1, epoch=0, **_new_table("b", 1, [0]))], StaleStep),         # an earlier one
        ([_pool_step(1, delta_seq_ids=["a"], delta_base_versions=[2], delta_versions=[5], delta_num_tokens=[0],
                     delta_num_replaced=[0], delta_num_appended=[0])], StaleTable),   # not the version held
        ([_pool_step(1, copy_src=[1], copy_dst=[])], InvalidForward),
        ([PoolStep(pool_id="other", epoch=1, step_id=1)], InvalidForward),
        ([_pool_step(1, copy_src=[16], copy_dst=[0], copy_is_defrag=[True])], InvalidForward),   # beyond the pool
        ([_pool_step(1, **_new_table("b", 1, [3, 2**32 - 1]))], InvalidForward),
    ],
)
def test_stage_refuses_steps_that_do_not_apply(steps: list, error: type) -> None:
    cache = TableCache()
    cache.put(SeqId("a"), NodeTable([3], 1, 2))
    with pytest.raises(error):
        stage(cache, steps, "n", 1, 16)


def test_reset_and_failed_steps() -> None:
    cache = TableCache()
    cache.commit(stage(cache, [_pool_step(1, **_new_table("a", 1, [0])), _pool_step(2, **_new_table("b", 2, [1]))],
                       "n", 1, 16))
    # Steps 3 and 4 were reported failed (the node may have applied them or not): step 5
    # builds on step 2 and is accepted either way.
    cache.commit(stage(cache, [_pool_step(3, **_new_table("c", 3, [2]))], "n", 1, 16))
    staged = stage(cache, [_pool_step(5, base=2, **_new_table("d", 5, [3]))], "n", 1, 16)
    assert staged.last_step_id == 5
    # A reset (the pool changed scheduler) forgets every table first.
    reset = _pool_step(9, base=0, reset=True, **_new_table("e", 9, [4]))
    cache.commit(stage(cache, [reset], "n", 1, 16))
    assert len(cache) == 1 and cache.get(SeqId("e")) is not None and cache.last_step_id == 9


def test_tail_rule_and_slots() -> None:
    """A sequence writes exactly at the tail the node holds; slots follow from its table."""
    g = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_size=4, num_blocks=8)

    def batch(context_len: int, n: int) -> ForwardBatch:
        req = pb.ForwardRequest(request_id="r", sequences=[pb.ForwardSequence(seq_id="s", num_new_tokens=n,
                                                                              context_len=context_len)])
        t = torch.zeros(n, 1, 4)
        req.layers.add(layer=0, query=encode_tensor(t), key=encode_tensor(t), value=encode_tensor(t))
        return parse_forward(req, g, 16)

    table = NodeTable([6, 2], 1, 5)
    b = batch(7, 2)
    resolve_sequences(b, lambda sid: table, 4)
    assert b.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2]   # positions 5, 6 in block 2
    for context_len, n in ((6, 2), (8, 2), (9, 4)):         # below the tail, past it, beyond the table
        with pytest.raises(InvalidForward):
            resolve_sequences(batch(context_len, n), lambda sid: table, 4)
    with pytest.raises(UnknownSequence):
        resolve_sequences(batch(7, 2), lambda sid: None, 4)


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


def test_a_pool_too_big_for_the_device_is_named_in_one_line() -> None:
    geometry = PoolGeometry(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16,
                            num_blocks=1 << 36)            # 64 PiB
    with pytest.raises(PoolAllocationError, match=r"cannot allocate the KV pool on cpu: \d+ blocks take \d"):
        KvPool(geometry, torch.device("cpu"))
