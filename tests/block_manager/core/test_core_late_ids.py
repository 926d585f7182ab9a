"""Late ids: an append whose last token's id comes with the next Step (a scheduler that plans
step N+1 while step N samples). Checked against a twin core that got every id at once: once
the ids arrive, both hold the same state (hashes, prefix index, step records), on the
item-by-item path and on the array path; a failure of the step that wrote a late-hashed
block unregisters it; a sequence with ids pending takes nothing else; snapshots keep them."""

from __future__ import annotations

import json
import random

import pytest

from block_manager.core import BlockManager, FailedPrecondition, InvalidRequest
from block_manager.core.append import VECTOR_MIN_ITEMS
from block_manager.core.errors import LateIdsPending, UnknownSequence
from tests.block_manager.core.one_pool import BS, one_pool, run_step


def _manager(num_blocks: int = 64, host: int = 0) -> BlockManager:
    return one_pool(num_blocks, host)


_run = run_step


def _normal(m: BlockManager) -> dict:
    """The snapshot, with each step's registrations as a set: a late id registers its block
    when it arrives, after the blocks that filled with known ids in the same step."""
    snap = m.to_snapshot()
    for pool in snap["pools"]:
        for record in pool["unsettled"]:
            record[1] = sorted(record[1])
        pool["step"]["registrations"] = sorted(pool["step"]["registrations"])
    return snap


def _same(a: BlockManager, b: BlockManager) -> None:
    assert _normal(a) == _normal(b)
    assert a.fsck() == [] and b.fsck() == []


@pytest.mark.parametrize("num_seqs", [3, VECTOR_MIN_ITEMS + 6])
def test_late_ids_end_in_the_same_state_as_ids_given_at_once(num_seqs: int) -> None:
    """Random prompts, then decode steps where every sequence's token is late (the async
    scheduler's pattern: the ids of step k arrive with step k+1), some sequences also
    appending a known chunk first. Whole-state equality with the twin after every step."""
    rng = random.Random(num_seqs)
    late_m, twin = _manager(num_blocks=40 * num_seqs), _manager(num_blocks=40 * num_seqs)
    ids = [f"s{i}" for i in range(num_seqs)]
    for m in (late_m, twin):
        rng_m = random.Random(7)
        for sid in ids:
            m.allocate(sid, "p", [rng_m.randrange(50) for _ in range(rng_m.randrange(1, 11))])
        _run(m)
    for _ in range(2 * BS + 3):
        pending: dict[str, int] = {}   # seq -> the id its late token gets
        counts, flat, late, direct = [], [], [], []
        for sid in ids:
            n_known = rng.choice([0, 0, 0, 1, 3])
            known = [rng.randrange(50) for _ in range(n_known)]
            token = rng.randrange(50)
            is_late = rng.random() < 0.6   # the others: in-block or crossing with known ids
            counts.append(n_known + 1)
            flat.extend([*known, 0 if is_late else token])   # 0: the late token's placeholder
            late.append(int(is_late))
            direct.extend([*known, token])
            if is_late:
                pending[sid] = token
        out = late_m.append_tokens(ids, counts, flat, num_late=late)
        assert out.failures == []
        ref = twin.append_tokens(ids, counts, direct)
        assert out.num_tokens == ref.num_tokens
        assert late_m.fsck() == []
        late_step = late_m.close_step("p")
        twin_step = twin.close_step("p")
        assert late_step == twin_step           # the node sees the same tables and slots
        # the next Step sends the ids first (the step above is still running)
        assert late_m.resolve_late(list(pending), [1] * len(pending), list(pending.values())) == []
        _same(late_m, twin)
        late_m.settle_steps("p", late_step.step_id)
        twin.settle_steps("p", twin_step.step_id)
    _same(late_m, twin)


def test_a_late_filled_block_is_a_prefix_hit_once_its_id_arrived() -> None:
    m = _manager()
    m.allocate("a", "p", [1, 2, 3])
    _run(m)
    before = m.num_prefix_hashes("p")
    m.append_tokens(["a"], [1], [0], num_late=[1])        # fills block 0; its last id unknown
    assert m.num_prefix_hashes("p") == before              # not hashed on a placeholder
    step = m.close_step("p")
    assert m.resolve_late(["a"], [1], [4]) == []
    assert m.num_prefix_hashes("p") == before + 1
    m.settle_steps("p", step.step_id)
    r = m.allocate("b", "p", [1, 2, 3, 4, 5])
    assert r.num_cached_tokens == 4 and m.fsck() == []


def test_a_failed_step_unregisters_the_block_its_late_token_filled() -> None:
    """The hash is recorded in the step that wrote the block, not the one that brought the
    id: if that Forward fails, no later prefix hit may read the block."""
    m = _manager()
    m.allocate("a", "p", [1, 2, 3])
    _run(m)
    m.append_tokens(["a"], [1], [0], num_late=[1])
    step = m.close_step("p")
    assert m.resolve_late(["a"], [1], [4]) == []     # the id arrives while the step runs
    res = m.settle_steps("p", step.step_id - 1, failed_from=step.step_id)
    assert res.dropped_seq_ids == ("a",)
    r = m.allocate("b", "p", [1, 2, 3, 4, 5])
    assert r.num_cached_tokens == 0 and m.fsck() == []


def test_an_id_arriving_after_its_step_settled_is_hashed_in_the_open_step() -> None:
    m = _manager()
    m.allocate("a", "p", [1, 2, 3])
    _run(m)
    m.append_tokens(["a"], [1], [0], num_late=[1])
    _run(m)
    assert m.resolve_late(["a"], [1], [4]) == []
    assert m.allocate("b", "p", [1, 2, 3, 4, 9]).num_cached_tokens == 4
    assert m.fsck() == []


def test_a_sequence_whose_ids_are_pending_takes_nothing_else() -> None:
    m = _manager(host=16)
    m.allocate("a", "p", [1, 2, 3, 4, 5, 6])
    _run(m)
    m.append_tokens(["a"], [1], [0], num_late=[1])
    _run(m)
    snap = m.to_snapshot()
    out = m.append_tokens(["a"], [1], [8])
    assert isinstance(out.failures[0][1], LateIdsPending) and isinstance(out.failures[0][1], FailedPrecondition)
    out = m.append_tokens(["a"], [1], [8], already_written=True)
    assert isinstance(out.failures[0][1], LateIdsPending)
    with pytest.raises(LateIdsPending):
        m.fork("a", ["b"])
    with pytest.raises(LateIdsPending):
        m.swap_out(["a"])
    assert m.to_snapshot() == snap
    # wrong count, a bad id, an unknown sequence: refused item by item, nothing changed
    fails = m.resolve_late(["a", "zz"], [2, 0], [7, 8])
    assert [type(e) for _, e in fails] == [InvalidRequest, UnknownSequence]
    fails = m.resolve_late(["a"], [1], [1 << 63])
    assert [type(e) for _, e in fails] == [InvalidRequest]
    assert m.to_snapshot() == snap
    with pytest.raises(InvalidRequest):
        m.resolve_late(["a"], [1, 1], [7])
    assert m.resolve_late(["a"], [1], [7]) == []
    assert m.append_tokens(["a"], [1], [8]).failures == []
    m.fork("a", ["b"])
    assert m.fsck() == []


def test_late_ids_must_lie_in_the_last_block_and_are_not_for_written_reports() -> None:
    m = _manager()
    m.allocate("a", "p", [1, 2, 3])
    _run(m)
    snap = m.to_snapshot()
    out = m.append_tokens(["a"], [3], [4, 5, 6], num_late=[3])   # token 4 ends block 0: not in the last
    assert isinstance(out.failures[0][1], InvalidRequest)
    out = m.append_tokens(["a"], [1], [4], num_late=[2])
    assert isinstance(out.failures[0][1], InvalidRequest)
    with pytest.raises(InvalidRequest):
        m.append_tokens(["a"], [1], [4], num_late=[1, 0])
    with pytest.raises(InvalidRequest):
        m.append_tokens(["a"], [1], [4], already_written=True, num_late=[1])
    assert m.to_snapshot() == snap
    assert m.append_tokens(["a"], [3], [4, 5, 0], num_late=[2]).failures == []   # tokens 5, 6 in block 1
    assert m.resolve_late(["a"], [2], [5, 6]) == []
    _run(m)
    assert m.allocate("b", "p", [1, 2, 3, 4, 5, 6, 9]).num_cached_tokens == 4
    assert m.fsck() == []


def test_pending_late_ids_survive_a_snapshot() -> None:
    m = _manager()
    m.allocate("a", "p", [1, 2, 3])
    _run(m)
    m.append_tokens(["a"], [1], [0], num_late=[1])
    step = m.close_step("p")
    snap = m.to_snapshot()
    m2 = BlockManager.from_snapshot(json.loads(json.dumps(snap)))
    assert m2.to_snapshot() == snap and m2.fsck() == []
    assert m2.resolve_late(["a"], [1], [4]) == []
    m2.settle_steps("p", step.step_id)
    assert m2.allocate("b", "p", [1, 2, 3, 4, 5]).num_cached_tokens == 4


def test_a_sequence_without_ids_needs_none_later() -> None:
    """An append without ids stops hashing; late counts then mean nothing and ids sent
    for it are accepted and dropped (the scheduler need not know which sequences hash)."""
    m = _manager()
    m.allocate("a", "p", num_tokens=3)
    _run(m)
    assert m.append_tokens(["a"], [1], [0], num_late=[1]).failures == []
    assert m.resolve_late(["a"], [1], [4]) == []
    assert m.append_tokens(["a"], [1], [5]).failures == []
    assert m.fsck() == []
