"""The compute node's host tier (compute_node/host_pool.py): batched device<->host moves equal
block-by-block copies in every layer, a Forward's moves, copies and fetched blocks apply in step order, and a
step naming a block outside either tier, or an unknown kind, is refused before anything moves."""

from __future__ import annotations

import pytest
import torch

from compute_node.errors import InvalidForward
from compute_node.host_pool import HostKvPool, apply_moves, host_blocks_for_budget
from compute_node.pool import KvPool, PoolGeometry
from compute_node.tables import StagedSteps, TableCache, stage
from pagedkv.v1 import common_pb2

GEOM = PoolGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, num_blocks=10)


def _pools(seed: int) -> tuple[KvPool, HostKvPool]:
    torch.manual_seed(seed)
    pool = KvPool(GEOM, torch.device("cpu"))
    for t in (*pool.key_caches, *pool.value_caches):
        t.copy_(torch.randn_like(t))
    host = HostKvPool(GEOM, 7, torch.device("cpu"))
    for t in (*host.key_caches, *host.value_caches):
        t.copy_(torch.randn_like(t))
    return pool, host


def test_batched_moves_equal_per_block_copies() -> None:
    pool, host = _pools(1)
    want_dev = [t.clone() for t in (*pool.key_caches, *pool.value_caches)]
    want_host = [t.clone() for t in (*host.key_caches, *host.value_caches)]
    to_host = [(9, 0), (2, 5), (4, 6)]      # shuffled, non-contiguous
    to_dev = [(3, 1), (6, 7), (1, 0)]       # reads a host block written by to_host (6): after it
    for d, h in to_host:
        for dev, hst in zip(want_dev, want_host):
            hst[h] = dev[d]
    for h, d in to_dev:
        for dev, hst in zip(want_dev, want_host):
            dev[d] = hst[h]
    host.to_host(pool, to_host)
    host.to_device(pool, to_dev)
    for got, want in zip((*pool.key_caches, *pool.value_caches), want_dev):
        assert torch.equal(got, want)
    for got, want in zip((*host.key_caches, *host.value_caches), want_host):
        assert torch.equal(got, want)
    assert (host.num_blocks_to_host, host.num_blocks_to_device) == (3, 3)


def test_moves_and_copies_apply_in_step_order() -> None:
    """Step 1 copies block 1 -> 2 (copy-on-write); step 2 swaps block 2 out: the host gets the
    copied content, not block 2's old one."""
    pool, host = _pools(2)
    src = pool.key_caches[0][1].clone()
    staged = StagedSteps(copy_pairs=[(1, 2)], tier_moves=[(1, [(2, 3)], [])])
    apply_moves(pool, host, staged)
    assert torch.equal(host.key_caches[0][3], src)


def test_fetched_blocks_land_between_their_steps_moves_and_copies_and_the_next_steps() -> None:
    """Step 1 swaps block 0 out and fetches into it; step 2 copies it to block 1 and fetches
    into block 2; step 3 swaps block 1 out and copies block 2 to 3. Each fetch lands after its
    own step's moves and copies and before the next step's: the swap-out of step 1 keeps block
    0's old bytes, every later reader sees the fetched ones."""
    pool, host = _pools(3)
    old0 = pool.key_caches[0][0].clone()
    steps = [
        common_pb2.PoolStep(pool_id="n", epoch=1, step_id=1, tier_kind=[1], tier_src=[0], tier_dst=[0],
                            fetches=[common_pb2.KvFetch(fetch_id="f1", src_blocks=[9], dst_blocks=[0])]),
        common_pb2.PoolStep(pool_id="n", epoch=1, step_id=2, base_step_id=1, copy_src=[0], copy_dst=[1],
                            copy_is_defrag=[False],
                            fetches=[common_pb2.KvFetch(fetch_id="f2", src_blocks=[9], dst_blocks=[2])]),
        common_pb2.PoolStep(pool_id="n", epoch=1, step_id=3, base_step_id=2, tier_kind=[1], tier_src=[1],
                            tier_dst=[1], copy_src=[2], copy_dst=[3], copy_is_defrag=[False]),
    ]
    staged = stage(TableCache(), steps, "n", 1, GEOM.num_blocks, 7)
    assert staged.fetch_marks == [(0, 1), (1, 1)] and not staged.lands_last(0) and not staged.lands_last(1)

    def write(block: int, value: float) -> None:
        for t in (*pool.key_caches, *pool.value_caches):
            t[block] = value

    apply_moves(pool, host, staged, None, [(staged.fetch_marks[0], lambda: write(0, 1.0)),
                                           (staged.fetch_marks[1], lambda: write(2, 2.0))])
    assert torch.equal(host.key_caches[0][0], old0)
    for block, value in ((0, 1.0), (1, 1.0), (2, 2.0), (3, 2.0)):
        assert bool((pool.key_caches[0][block] == value).all()) and bool((pool.value_caches[2][block] == value).all())
    assert bool((host.key_caches[1][1] == 1.0).all())


def _step(**cols: list[int]) -> common_pb2.PoolStep:
    return common_pb2.PoolStep(pool_id="n", epoch=1, step_id=1, **cols)


@pytest.mark.parametrize("cols, match", [
    (dict(tier_kind=[1], tier_src=[10], tier_dst=[0]), "outside the pool"),     # device id 10 of 10
    (dict(tier_kind=[2], tier_src=[7], tier_dst=[0]), "outside the pool"),      # host id 7 of 7
    (dict(tier_kind=[9], tier_src=[0], tier_dst=[0]), "unknown tier move kind"),
    (dict(tier_kind=[1, 2], tier_src=[0], tier_dst=[0]), "different lengths"),
])
def test_bad_tier_moves_are_refused(cols: dict, match: str) -> None:
    with pytest.raises(InvalidForward, match=match):
        stage(TableCache(), [_step(**cols)], "n", 1, GEOM.num_blocks, 7)


def test_staged_tier_moves_by_direction() -> None:
    staged = stage(TableCache(), [_step(tier_kind=[1, 3, 2, 4], tier_src=[0, 1, 2, 3], tier_dst=[4, 5, 6, 7],
                                        copy_src=[8], copy_dst=[9], copy_is_defrag=[False])],
                   "n", 1, GEOM.num_blocks, 7)
    assert staged.tier_moves == [(0, [(0, 4), (1, 5)], [(2, 6), (3, 7)])]
    assert staged.copy_pairs == [(8, 9)]


def test_host_budget_in_blocks() -> None:
    assert host_blocks_for_budget(5 * GEOM.bytes_per_block + 1, GEOM) == 5
    assert HostKvPool(GEOM, 5, torch.device("cpu")).num_bytes == 5 * GEOM.bytes_per_block
