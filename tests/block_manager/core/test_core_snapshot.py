"""Snapshots (complete, JSON round trip, resumable) and hash determinism across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from block_manager.core import (
    AppendRequest,
    BlockManager,
    DefragPolicy,
    InvalidRequest,
    hash_block,
    hash_prefix,
)


def busy_manager() -> BlockManager:
    """A state with every kind of thing in it: two pools, cached blocks, shared blocks,
    CoW ops in an open step, a closed unsettled step, an outstanding defrag plan with a held
    source, step counters."""
    m = BlockManager(watermark=0.05, defrag_policy=DefragPolicy(every_n_steps=7))
    m.add_pool("a", 32, 4)
    m.add_pool("b", 16, 8)
    for i in range(6):
        m.allocate(f"x{i}", "a", list(range(i, i + 9 + i)), salt="t" if i % 2 else None)
    m.allocate("y0", "b", num_tokens=20)
    for out in m.close_steps():
        m.settle_steps(out.pool_id, out.step_id)
    m.fork("x1", ["x1a", "x1b"])
    m.append_slots([AppendRequest("x1a", 1, (7,)), AppendRequest("y0", 3)])
    m.close_step("b")  # closed, not settled
    m.free(["x0", "x2"])
    plan = m.plan_defrag("a")
    assert plan is not None
    owner = next(v.seq_id for v in m.sequences("a") if plan.moves[-1].src in v.block_table)
    m.free([owner])
    m.set_draining("b", True)
    assert m.fsck() == []
    return m


def continue_workload(m: BlockManager) -> list[object]:
    """Deterministic follow-up calls; returns everything they returned."""
    out: list[object] = []
    out.append(m.append_slots([AppendRequest(v.seq_id, 5) for v in m.sequences("a")]))
    plan = m.get_defrag_plan("a")
    assert plan is not None
    out.append(m.close_steps())
    out.append(m.settle_steps("a", m.open_step_id("a") - 1))
    out.append(m.settle_steps("b", 1, failed_from=2))
    out.append(m.close_steps())
    out.append(m.allocate("z", "a", list(range(3, 15))))
    out.append(m.metrics("a"))
    out.append(m.route(list(range(20))))
    out.append(m.close_steps())
    out.append(m.settle_steps("a", m.open_step_id("a") - 1))
    m.free([v.seq_id for v in m.sequences("a")])
    out.append(m.allocate("w", "a", num_tokens=40))
    out.append(m.metrics("a"))
    out.append(m.to_snapshot())
    return out


def test_snapshot_is_json_and_round_trips() -> None:
    m = busy_manager()
    snap = m.to_snapshot()
    text = json.dumps(snap)
    restored = BlockManager.from_snapshot(json.loads(text))
    assert restored.to_snapshot() == snap
    assert restored.fsck() == []


def test_restored_manager_continues_identically() -> None:
    original = busy_manager()
    restored = BlockManager.from_snapshot(json.loads(json.dumps(original.to_snapshot())))
    assert continue_workload(original) == continue_workload(restored)


def test_snapshot_of_empty_manager() -> None:
    m = BlockManager()
    assert BlockManager.from_snapshot(m.to_snapshot()).to_snapshot() == m.to_snapshot()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d.pop("pools"),
        lambda d: d.update(format=99),
        lambda d: d["pools"][0]["ref_cnt"].__setitem__(0, 5),
        lambda d: d["pools"][0]["free_list"].append(d["pools"][0]["free_list"][0]),
        lambda d: d["pools"][0]["free_list"].pop(),
        lambda d: d["pools"][0]["sequences"][0]["block_table"].append(0),
        lambda d: d["pools"][0].update(num_used=0),
        lambda d: d["pools"][0]["hashed_blocks"][0].__setitem__(1, "zz"),
        lambda d: d["seq_order"].append("ghost"),
        lambda d: d.update(watermark=2.0),
        lambda d: d["pools"][0]["step"]["copy_ops"].reverse(),
        lambda d: d["pools"][1].update(settled_step=9),
        lambda d: d["pools"][0]["sequences"][0].update(last_step=99),
    ],
)
def test_malformed_snapshot_is_rejected(corrupt) -> None:
    snap = json.loads(json.dumps(busy_manager().to_snapshot()))
    assert len(snap["pools"][0]["step"]["copy_ops"]) >= 2
    corrupt(snap)
    with pytest.raises(InvalidRequest):
        BlockManager.from_snapshot(snap)


_CHAIN_SCRIPT = """
import json, sys
from block_manager.core import hash_prefix, hash_block
tokens = list(range(-5, 45)) + [2**62, -2**63]
out = [h.hex() for h in hash_prefix(tokens, 4, "tenant-é")]
out.append(hash_block(None, [1, 2, 3], None).hex())
out.append(hash_block(None, [1, 2, 3], "").hex())
print(json.dumps(out))
"""


def test_hash_chain_is_identical_in_another_process() -> None:
    here = [h.hex() for h in hash_prefix(list(range(-5, 45)) + [2**62, -2**63], 4, "tenant-é")]
    here.append(hash_block(None, [1, 2, 3], None).hex())
    here.append(hash_block(None, [1, 2, 3], "").hex())
    env_runs = []
    for seed in ("0", "12345"):
        proc = subprocess.run(
            [sys.executable, "-c", _CHAIN_SCRIPT], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        )
        env_runs.append(json.loads(proc.stdout))
    assert env_runs[0] == here and env_runs[1] == here
    assert len(set(here)) == len(here)  # None salt, "" salt and every block differ


def test_hash_depends_on_parent_salt_and_tokens() -> None:
    base = hash_block(None, [1, 2], None)
    assert hash_block(base, [1, 2], None) != base
    assert hash_block(None, [1, 2], "s") != base
    assert hash_block(None, [2, 1], None) != base
    assert hash_block(None, [1, 2, 0], None) != base
    assert hash_block(None, [1, 2], None) == base
    assert hash_prefix([1, 2, 3, 4, 5], 2) == [
        hash_block(None, [1, 2], None),
        hash_block(hash_block(None, [1, 2], None), [3, 4], None),
    ]
    with pytest.raises(InvalidRequest):
        hash_block(None, [1.5], None)  # type: ignore[list-item]


def test_hash_encoding_is_pinned() -> None:
    """Journals and snapshots store these digests: changing the encoding breaks recovery
    of existing state, so it must be a deliberate, versioned change."""
    assert hash_block(None, [1, 2, 3], None).hex() == (
        "f9c9c678af21fc686605c5eecc07eef2f5bcf8f3410c45d6111ee033c23ec162"
    )
    assert hash_prefix(list(range(8)), 4, "t")[-1].hex() == (
        "441cf633db7c52cb72e35003d10c32dbdb6bde3e8f024d69959c5a89ef961c20"
    )


def test_snapshot_keeps_the_pipelining_depth() -> None:
    m = BlockManager(max_unsettled_steps=7)
    m.add_pool("p", 8, 4)
    assert BlockManager.from_snapshot(json.loads(json.dumps(m.to_snapshot()))).max_unsettled_steps == 7


@pytest.mark.parametrize(
    ("tail", "message"),
    [([1 << 70], "not an int64"), ([1, 2, 3, 4, 5, 6], "exceed a block"), ([], "tail tokens for 5 tokens")],
)
def test_snapshot_with_a_bad_tail_is_refused(tail: list[int], message: str) -> None:
    """The partial block's tokens live in a fixed-width int64 column: a snapshot whose tail
    does not fit it (too long, not int64) or disagrees with the token count is refused with
    InvalidRequest, never a crash."""
    m = BlockManager()
    m.add_pool("p", 8, 4)
    m.allocate("a", "p", [1, 2, 3, 4, 5])
    data = m.to_snapshot()
    data["pools"][0]["sequences"][0]["tail_token_ids"] = tail
    with pytest.raises(InvalidRequest, match=message):
        BlockManager.from_snapshot(data)
