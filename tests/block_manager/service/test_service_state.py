"""Pure pieces: the node registry and the service state machine (no gRPC)."""

from __future__ import annotations

import json

import pytest

from block_manager.core.errors import FailedPrecondition, InvalidRequest, NodeFenced, StaleEpoch, UnknownPool
from block_manager.core.nodes import NodeRegistry
from block_manager.service.state import ServiceState, StateConfig


def test_registry_epochs_leases_and_fencing() -> None:
    reg = NodeRegistry(lease_ttl_s=5.0)
    a = reg.register("n1", 8, 4, {"head_dim": 8}, "h:1", now=100.0)
    assert (a.epoch, a.lease_deadline) == (1, 105.0)
    assert reg.next_deadline() == 105.0
    reg.heartbeat("n1", 1, now=103.0)
    assert reg.expired(107.0) == []
    assert [n.node_id for n in reg.expired(108.0)] == ["n1"]
    with pytest.raises(StaleEpoch):
        reg.check_epoch("n1", 2)
    with pytest.raises(InvalidRequest):
        reg.check_epoch("n1", 0)
    with pytest.raises(UnknownPool):
        reg.check_epoch("zz", 1)
    with pytest.raises(NodeFenced):
        reg.heartbeat("n1", 1, now=108.5)  # lapsed, even before the expiry is processed
    assert reg.fence("n1", 1) and not reg.fence("n1", 1)  # idempotent
    with pytest.raises(NodeFenced):
        reg.check_epoch("n1", 1)
    assert reg.next_deadline() is None
    b = reg.register("n1", 8, 4, None, "", now=200.0)
    assert b.epoch == 2 and reg.check_epoch("n1", 2).active
    assert not reg.fence("n1", 1)  # a stale expiry cannot fence the new epoch


def test_registry_snapshot_renews_leases() -> None:
    reg = NodeRegistry(lease_ttl_s=5.0)
    reg.register("n1", 8, 4, {}, "", now=0.0)
    reg.register("n2", 8, 4, {}, "", now=0.0)
    reg.fence("n2", 1)
    data = json.loads(json.dumps(reg.to_snapshot()))
    back = NodeRegistry.from_snapshot(data, now=1000.0)
    assert back.to_snapshot() == data
    assert back.get("n1").lease_deadline == 1005.0 and back.get("n2").fenced
    with pytest.raises(InvalidRequest):
        NodeRegistry.from_snapshot({"nodes": [{}]}, now=0.0)


def _state() -> ServiceState:
    s = ServiceState(StateConfig(default_block_size=4, max_blocks=64))
    s.apply("register_node", {"node_id": "n1", "num_blocks": 16, "block_size": 0, "geometry": {}, "address": ""}, 0.0)
    return s


def _alloc(seq_id: str, tokens: list[int] | None = None, num_tokens: int = 0, num_compute: int = 0) -> dict:
    return {"seq_ids": [seq_id], "pools": ["n1"], "salts": [], "pool_index": [0], "salt_index": [-1],
            "num_token_ids": [len(tokens or [])], "token_ids": tokens or [],
            "num_tokens": [0 if tokens else num_tokens], "num_compute": [num_compute]}


def _step(**sections: object) -> dict:
    return {"scheduler_id": "s", **sections}


def test_apply_rejects_bad_payloads_without_changes() -> None:
    s = _state()
    s.apply("step", _step(alloc=_alloc("a", num_tokens=5)), 0.0)
    before = s.to_snapshot()
    bad = [
        ("nope", {}),
        ("allocate", {"items": []}),  # the pre-step operations are gone
        ("step", {}),  # no scheduler
        ("step", _step(alloc={**_alloc("b", num_tokens=1), "pools": [["x"]]})),
        ("step", _step(alloc={**_alloc("b", num_tokens=1), "pool_index": [1]})),
        ("step", _step(alloc={**_alloc("b", num_tokens=1), "num_compute": []})),
        ("step", _step(append={"seq_ids": ["a", ["unhashable"]], "num_tokens": [1, 1], "token_ids": []})),
        ("step", _step(append={"seq_ids": ["a"], "num_tokens": [0], "token_ids": []})),
        ("step", _step(append={"seq_ids": ["a", "a"], "num_tokens": [1, 1], "token_ids": []})),
        ("step", _step(free=["a", "a"])),
        ("step", _step(fork={"parents": ["a"], "num_children": [2], "children": ["c"]})),
        ("step", _step(reports=[["n1", 1, 5, 0]])),
        ("register_node", {"node_id": "n1", "num_blocks": 10**9, "block_size": 4}),
        ("register_node", {"node_id": "n1", "num_blocks": 8, "block_size": 4, "geometry": "x"}),
    ]
    for op, payload in bad:
        with pytest.raises((InvalidRequest, FailedPrecondition)):
            s.apply(op, payload, 0.0)
        assert s.to_snapshot() == before, (op, payload)


def test_replay_reproduces_state_and_results() -> None:
    ops = [
        ("step", _step(alloc=_alloc("a", tokens=list(range(9))))),
        ("step", _step(reports=[["n1", 1, 1, 0]], fork={"parents": ["a"], "num_children": [1], "children": ["b"]})),
        ("step", _step(append={"seq_ids": ["a", "b"], "num_tokens": [2, 3], "token_ids": [1, 2, 7, 8, 9]})),
        ("plan_defrag", {"pool_id": "n1", "kind": "compaction", "max_moves": None}),
        ("step", _step(reports=[["n1", 1, 2, 0]], free=["a"], alloc=_alloc("c", tokens=list(range(9)), num_compute=4))),
        ("step", _step(reports=[["n1", 1, 2, 3]])),
        ("release_pool", {"pool_id": "n1", "scheduler_id": "s", "epoch": 1}),
        ("expire_node", {"node_id": "n1", "epoch": 1}),
    ]
    live = _state()
    results = [live.apply(op, p, 1.0).result for op, p in ops]
    # the journal hands payloads back JSON-decoded; replay must not care
    replayed = _state()
    again = [replayed.apply(op, json.loads(json.dumps(p)), 99.0).result for op, p in ops]
    assert json.loads(json.dumps(results)) == json.loads(json.dumps(again))
    assert replayed.to_snapshot() == live.to_snapshot()
    assert live.fsck() == []
    assert results[4]["alloc_num_cached_tokens"] == [8] and results[4]["alloc_num_tokens"] == [9]
    restored = ServiceState.from_snapshot(json.loads(json.dumps(live.to_snapshot())), live.config, now=5.0)
    assert restored.to_snapshot() == live.to_snapshot()
