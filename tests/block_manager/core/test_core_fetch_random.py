"""Prefix fetch under random traces (block_manager/core/fetch.py): three pools, prompts sharing
a few prefixes (one small pool with a host tier its evictions offload to), allocations with fetch
sources, steps reported done or failed in any order of
pools, frees, evictions, defrag attempts, a pool removed and re-added, snapshot round trips. After
every action fsck is clean (loans counted with the tables, none outliving its destination's
report, every open fetch op with its loan); at the end, with everything freed and reported,
nothing is pinned and every block is free or cached."""

from __future__ import annotations

import random

from block_manager.core import BlockManager, CoreError

BS = 4
POOLS = ("p0", "p1", "p2")
# small pools that evict; p1 has a host tier its evictions offload to, whose blocks are lent too
HOST = {"p1": 24}
SIZE = {"p0": 24, "p1": 16, "p2": 24}


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    base = rng.choice(prefixes)
    cut = rng.randrange(BS, len(base) + 1)
    return base[:cut] + [rng.randrange(1, 100) for _ in range(rng.randrange(1, 9))]


def _settle(m: BlockManager, pool: str, ok: bool) -> None:
    out = m.close_step(pool, force=True) if m.can_close_step(pool) or m._pools[pool].step.dirty else None
    last = m.open_step_id(pool) - 1
    if last <= m.settled_step_id(pool):
        return
    if ok or out is None:
        m.settle_steps(pool, last)
    else:
        m.settle_steps(pool, m.settled_step_id(pool), failed_from=m.settled_step_id(pool) + 1)


def test_random_fetch_traces_keep_every_invariant() -> None:
    counts = [_trace(seed) for seed in range(8)]
    # the traces did fetch, from device and from host blocks: otherwise they would prove nothing
    assert sum(c[0] for c in counts) > 0 and sum(c[1] for c in counts) > 0, counts


def _trace(seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    m = BlockManager(watermark=0.0)
    for p in POOLS:
        m.add_pool(p, SIZE.get(p, 40), BS, host_num_blocks=HOST.get(p, 0))
    prefixes = [[rng.randrange(1, 100) for _ in range(6 * BS)] for _ in range(10)]
    live: dict[str, str] = {}
    fetched = from_host = 0
    for i in range(300):
        action = rng.random()
        # the small host-tier pool is picked most: it computes prefixes, evicts them to host
        pool = rng.choice([p for p in (*POOLS, "p1", "p1") if p in m.pool_ids] or ["p0"])
        try:
            if action < 0.4 and pool in m.pool_ids:
                sid = f"s{i}"
                r = m.allocate(sid, pool, _prompt(rng, prefixes), fetch_sources=[p for p in POOLS if p in m.pool_ids])
                live[sid] = pool
                ops = [op for op in m._pools[pool].step.fetches if op.seq_id == sid]
                fetched += sum(len(op.dst_blocks) for op in ops)
                from_host += sum(sum(op.src_host) for op in ops)
                assert r.num_cached_tokens % BS == 0
            elif action < 0.65 and pool in m.pool_ids:
                _settle(m, pool, ok=rng.random() < 0.8)
            elif action < 0.8 and live:
                sid = rng.choice(sorted(live))
                if m.has_sequence(sid):
                    m.free([sid])
                live.pop(sid)
            elif action < 0.85 and pool in m.pool_ids:
                m.evict(pool, rng.randrange(1, 6))
            elif action < 0.88 and pool in m.pool_ids:
                m.plan_defrag(pool, "compaction", 4)
            elif action < 0.9 and pool in m.pool_ids:
                m.abandon_pool(pool)
                live = {s: p for s, p in live.items() if p != pool}
            elif action < 0.92 and pool in m.pool_ids:
                m.remove_pool(pool)
                live = {s: p for s, p in live.items() if p != pool}
            elif action < 0.94 and pool not in m.pool_ids:
                m.add_pool(pool, SIZE.get(pool, 40), BS, host_num_blocks=HOST.get(pool, 0))
            elif action < 0.96:
                m = BlockManager.from_snapshot(m.to_snapshot())
        except CoreError:
            pass   # refused actions change nothing (the core's contract); fsck below checks it
        for sid in [s for s in live if not m.has_sequence(s)]:
            live.pop(sid)        # dropped by a failed step
        problems = m.fsck()
        assert problems == [], (i, problems[:5])
    # drain: report everything, free everything: no loan, no reference left
    for p in m.pool_ids:
        _settle(m, p, ok=True)
    m.free([s for s in live if m.has_sequence(s)])
    for p in m.pool_ids:
        _settle(m, p, ok=True)
        m.close_step(p, force=True)
        _settle(m, p, ok=True)
    assert m.fsck() == []
    for p in m.pool_ids:
        assert m.fetch_counts(p)[1] == 0, p
        free, usable = m.free_blocks(p)
        assert usable == SIZE.get(p, 40), (p, free, usable)
    return fetched, from_host
