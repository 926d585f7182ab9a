"""Admission placement inside the Step (issue 21): an allocation may name no pool; the block
manager places it (cached prefix, then free blocks charged per step, among the candidate pools
this scheduler may drive), admits placed allocations in order within the step's budget, and
answers where each went. Over real gRPC."""

from __future__ import annotations

import pytest

from block_manager.client import BlockManagerClient, ItemFailure, OutOfBlocksError
from block_manager.core.types import SeqId
from tests.block_manager.client.step_workload import forwarded

BS = 8


@pytest.fixture
def client(bm):  # type: ignore[no-untyped-def]
    with BlockManagerClient(bm.address) as c:
        yield c


def _prompt(base: int, n: int = 16) -> list[int]:
    return [base + t for t in range(n)]


def test_placed_allocations_spread_follow_prefixes_and_respect_candidates(client, bm) -> None:  # type: ignore[no-untyped-def]
    client.register_node("n1", 64, block_size=BS)
    client.register_node("n2", 60, block_size=BS)
    step = client.step()
    for i in range(6):
        step.allocate(f"s{i}", None, _prompt(1000 * (i + 1)))
    res = forwarded(client, step.commit())
    pools = {sid: adm.pool_id for sid, adm in res.allocations.items()}
    assert set(pools.values()) == {"n1", "n2"}                    # charged per step: spread, not piled
    for sid, pool in pools.items():
        assert bm.state.core.get_sequence(SeqId(sid)).pool_id == pool
    # a prompt sharing s4's first two blocks goes where they are cached
    step = client.step()
    step.free(list(pools))
    forwarded(client, step.commit())
    step = client.step()
    step.allocate("again", None, _prompt(5000)[:16] + [7, 7, 7])
    adm = forwarded(client, step.commit()).allocations[SeqId("again")]
    assert adm.pool_id == pools[SeqId("s4")] and adm.num_cached_tokens == 16
    # only the candidates are used
    step = client.step()
    step.place_pools = ["n2"]
    for i in range(3):
        step.allocate(f"c{i}", None, _prompt(90_000 + 100 * i))
    res = forwarded(client, step.commit())
    assert {a.pool_id for a in res.allocations.values()} == {"n2"}
    assert bm.fsck() == []


def test_the_admission_budget_admits_in_order_and_refuses_the_rest(client, bm) -> None:  # type: ignore[no-untyped-def]
    client.register_node("n1", 64, block_size=BS)
    step = client.step()
    step.admit_budget = 20
    for i in range(3):
        step.allocate(f"b{i}", None, _prompt(100 * (i + 1)))
    res = forwarded(client, step.commit())
    first, second, third = (res.allocations[SeqId(f"b{i}")] for i in range(3))
    assert (first.num_tokens, second.num_tokens) == (16, 4)        # the second is a 4-token chunk
    assert isinstance(third, ItemFailure) and isinstance(third.error, OutOfBlocksError)
    assert third.error.reason == "NotPlaced"
    assert not bm.state.core.has_sequence(SeqId("b2")) and bm.fsck() == []


def test_no_pool_to_place_on_is_a_refusal_not_a_failed_step(client, bm) -> None:  # type: ignore[no-untyped-def]
    client.register_node("n1", 64, block_size=BS)
    step = client.step()
    step.place_pools = ["nope"]
    step.allocate("x", None, _prompt(1))
    step.allocate("y", "n1", _prompt(2))                          # a named pool still works beside it
    res = forwarded(client, step.commit())
    assert isinstance(res.allocations[SeqId("x")], ItemFailure)
    assert res.allocations[SeqId("y")].pool_id == "n1"


def test_a_prefix_on_a_draining_pool_is_fetched_by_the_pool_placed_on(client, bm) -> None:  # type: ignore[no-untyped-def]
    """Prefix fetch (docs/prefix_fetch.md): n1 holds the prefix and drains; the prompt is
    placed on n2 with a fetch: n2's PoolStep pulls n1's blocks, n1's PoolStep (closed in the
    same Step) grants exactly those blocks, and n1's blocks stay pinned until n2's step is
    reported. Route says per candidate what is local, fetchable and missing."""
    from block_manager.client.admin import AdminClient

    client.register_node("n1", 64, block_size=BS, address="127.0.0.1:1111")
    client.register_node("n2", 64, block_size=BS, address="127.0.0.1:2222")
    prompt = _prompt(7000, 5 * BS + 3)
    step = client.step()
    step.allocate("first", "n1", prompt)
    forwarded(client, step.commit())
    step = client.step()
    step.free(["first"])
    forwarded(client, step.commit())
    with AdminClient(bm.address) as admin:
        admin.drain_node("n1")
    step = client.step()
    step.allocate("again", None, prompt)
    res = step.commit()
    adm = res.allocations[SeqId("again")]
    assert adm.pool_id == "n2" and adm.num_cached_tokens == 5 * BS      # fetched counts as cached
    (fetch,) = res.steps["n2"].message.fetches
    (grant,) = res.steps["n1"].message.serves
    assert fetch.src_pool_id == "n1" and fetch.src_address == "127.0.0.1:1111"
    assert list(fetch.src_blocks) == list(grant.blocks) and len(grant.blocks) == 5
    assert grant.fetch_id == fetch.fetch_id and grant.dst_pool_id == "n2"
    assert list(fetch.token_ids) == prompt[: 5 * BS] and fetch.first_token == 0
    core = bm.state.core
    assert core.fetch_counts("n1") == (0, 5) and bm.fsck() == []
    forwarded(client, res)
    step = client.step()
    step.free(["again"])
    forwarded(client, step.commit())          # the report ends the loan
    assert core.fetch_counts("n1") == (0, 0) and core.fetch_counts("n2") == (5, 0)
    assert bm.fsck() == []
    entries = client.route(prompt)
    assert [e.pool_id for e in entries] == ["n2"]                        # draining n1 is no candidate
    e = entries[0]                                                       # committed: local on n2 now
    assert (e.num_cached_tokens, e.num_fetchable_tokens, e.num_missing_tokens) == (5 * BS, 0, 3)
    client.register_node("n3", 64, block_size=BS, address="127.0.0.1:3333")
    e3 = next(e for e in client.route(prompt) if e.pool_id == "n3")
    assert (e3.num_cached_tokens, e3.num_fetchable_tokens, e3.num_missing_tokens) == (0, 5 * BS, 3)
    assert e3.fetch_pool_id in ("n1", "n2")


def test_a_busy_pool_holding_the_prefix_lends_it_to_one_with_room(client, bm) -> None:  # type: ignore[no-untyped-def]
    """The cost model's queueing leg (docs/prefix_fetch.md): the pool with the prefix has no
    room left for the prompt's other blocks, so rather than the request queueing for it, it is
    placed on the pool with room, which fetches the prefix; with room on both, the local prefix
    wins (no fetch)."""
    client.register_node("n1", 16, block_size=BS, address="127.0.0.1:1111")
    client.register_node("n2", 16, block_size=BS, address="127.0.0.1:2222")
    prompt = _prompt(3000, 4 * BS + 5)
    step = client.step()
    step.allocate("first", "n1", prompt)
    forwarded(client, step.commit())
    step = client.step()
    step.free(["first"])
    forwarded(client, step.commit())
    step = client.step()
    step.allocate("again", None, prompt)                       # room on both: local wins
    res = forwarded(client, step.commit())
    adm = res.allocations[SeqId("again")]
    assert adm.pool_id == "n1" and not res.steps["n1"].message.fetches
    step = client.step()
    step.free(["again"])
    step.allocate("filler", "n1", _prompt(50_000, 12 * BS))     # n1: 4 cached + 12 used, 0 free
    forwarded(client, step.commit())
    step = client.step()
    step.allocate("busy", None, prompt)                        # needs 1 block beyond its prefix: n1 has 0
    res = step.commit()
    adm = res.allocations[SeqId("busy")]
    assert adm.pool_id == "n2" and adm.num_cached_tokens == 4 * BS
    (fetch,) = res.steps["n2"].message.fetches
    assert fetch.src_pool_id == "n1" and len(fetch.src_blocks) == 4
    forwarded(client, res)
    assert bm.fsck() == []
