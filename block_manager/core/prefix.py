"""The prefix cache's read side: where a prompt's cached prefix is, and where to place it.

A prompt's cached prefix is found along a chain of sources, each continuing the one before
(hits are full blocks, chained through their hashes, so a hit in a lower tier only counts
where the hits above it end):

1. device — blocks of the pool itself, shared by the new sequence;
2. host — the pool's host tier (tiers.py), onboarded host→device in the admitting step;
3. disk — the pool's disk tier (disk_tier.py), staged disk→host→device in that step;
4. remote — another pool's device and host blocks, fetched node to node (fetch.py).

`collect` walks the chain and returns `PrefixHits`; the allocation commits them
(allocation.py). Every source uses the same walk over a `BlockTier` (block_tier.py); they
differ only in which hit is usable (`written`: its writing step is reported complete — see
`device_hits` for the one exception) and where they stop. All hits are capped to leave one
prompt token to compute: the model needs a query token to produce the next token's logits.

`route` ranks pools for a prompt by the same chain (device hits, and what another pool could
lend), through the fetch cost model (`fetch.score`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from block_manager.core import defrag as _defrag
from block_manager.core import fetch as _fetch
from block_manager.core.block_tier import BlockTier
from block_manager.core.hashing import BlockHash, hash_prefix
from block_manager.core.pool import Pool
from block_manager.core.types import PoolId, RouteEntry


@dataclass(slots=True)
class PrefixQuery:
    """A prompt as the prefix lookups see it: its tokens and the chained hashes of its full
    blocks (for one block size)."""

    tokens: array
    hashes: list[BlockHash]
    salt: str | None
    block_size: int

    @classmethod
    def of(cls, tokens: array, block_size: int, salt: str | None) -> PrefixQuery:
        return cls(tokens, hash_prefix(tokens, block_size, salt), salt, block_size)

    @property
    def max_hits(self) -> int:
        """Full blocks a hit may cover: all but the one holding the last token."""
        return min(len(self.hashes), (len(self.tokens) - 1) // self.block_size)

    def parent(self, num_blocks: int) -> BlockHash | None:
        """The hash a hit at block `num_blocks` chains on."""
        return self.hashes[num_blocks - 1] if num_blocks else None

    def truncated(self, num_tokens: int) -> PrefixQuery:
        """The first `num_tokens` tokens (a chunked prefill's first chunk)."""
        return PrefixQuery(self.tokens[:num_tokens], self.hashes[: num_tokens // self.block_size], self.salt,
                           self.block_size)


def walk(tier: BlockTier, q: PrefixQuery, start: int, stop: int, usable: Callable[[int, int], bool]) -> list[int]:
    """Blocks of `tier` holding the prompt's blocks `start …` (up to `stop`), each chained on
    the one before; the walk ends at the first block not found or not `usable(i, block)`."""
    bs = q.block_size
    tokens, hashes, salt = q.tokens, q.hashes, q.salt
    parent = q.parent(start)
    out: list[int] = []
    for i in range(start, stop):
        b = tier.lookup(hashes[i], parent, salt, tuple(tokens[i * bs: (i + 1) * bs]))
        if b is None or not usable(i, b):
            break
        out.append(b)
        parent = hashes[i]
    return out


def device_hits(pool: Pool, q: PrefixQuery, *, same_step: bool = True) -> list[int]:
    """Blocks of the longest cached prefix on the pool's device tier.

    A hit is read, never written, by the new sequence's Forward, so it must hold its K/V
    by the time that Forward reads it. Blocks whose writing step is reported complete
    count; so, with `same_step`, do blocks filled in this very step (two prompts with one
    prefix admitted together, as vLLM's scheduler shares them): the node runs a step's
    K/V writes of a layer — copies, onboards and fetches before them — ahead of that
    layer's attention, and if the step fails every sequence it touched is dropped, the
    reader with the writer. Without it (a fetch source: another node reads the block
    before this step's Forward runs) only written blocks count. A block filled by a step
    still in flight is never a hit: the next step computes the prefix itself."""
    open_step = pool.step.step_id if same_step else None
    write_step = pool.write_step
    settled = pool.settled_step
    return walk(pool, q, 0, q.max_hits, lambda _, b: write_step[b] <= settled or write_step[b] == open_step)


def host_hits(pool: Pool, q: PrefixQuery, start: int) -> list[int]:
    """Written host blocks continuing a prefix hit of `start` blocks."""
    host = pool.host
    if host is None:
        return []
    settled = pool.settled_step
    return walk(host, q, start, q.max_hits, lambda _, h: host.written(h, settled))


def disk_hits(pool: Pool, q: PrefixQuery, start: int, host_room: int) -> list[int]:
    """Written disk slots continuing a (device + host) prefix hit of `start` blocks, capped by
    `host_room`: each one is staged through a fresh host block. Stops at a hash the host tier
    holds (it is not written yet there, or it is other content: either way not this prompt's
    prefix to serve)."""
    host = pool.host
    disk = None if host is None else host.disk
    if host is None or disk is None or host_room <= 0:
        return []
    settled = pool.settled_step
    index = host.prefix_index
    hashes = q.hashes
    return walk(disk, q, start, min(q.max_hits, start + host_room),
                lambda i, s: hashes[i] not in index and disk.written(s, settled))


@dataclass(slots=True)
class PrefixHits:
    """A prompt's cached prefix on one pool, source by source (module docstring)."""

    device: list[int] = field(default_factory=list)   # device blocks, shared
    host: list[int] = field(default_factory=list)     # host blocks, onboarded
    disk: list[int] = field(default_factory=list)     # disk slots, staged through host
    fetch: _fetch.FetchPlan | None = None             # another pool's blocks, fetched

    @property
    def num_local(self) -> int:
        return len(self.device) + len(self.host) + len(self.disk)

    @property
    def num_fetch(self) -> int:
        return 0 if self.fetch is None else len(self.fetch.src_blocks)

    @property
    def num_cached(self) -> int:
        """Blocks the new sequence gets without computing them."""
        return self.num_local + self.num_fetch


NO_HITS = PrefixHits()   # a prompt that is not hashed (shared: nothing mutates a collected PrefixHits)


def collect(pools: dict[PoolId, Pool], pool: Pool, q: PrefixQuery, fetch_sources: Seq[PoolId],
            max_unsettled_steps: int) -> PrefixHits:
    """The prompt's prefix hits on `pool`, along the chain device → host → disk → remote."""
    hits = PrefixHits(device_hits(pool, q))
    hits.host = host_hits(pool, q, len(hits.device))
    host = pool.host
    if host is not None and host.disk is not None:
        # the host room left once the host hits are pinned (a cached one leaves the LRU queue)
        room = host.num_available - sum(1 for h in hits.host if host.ref_cnt[h] == 0)
        hits.disk = disk_hits(pool, q, len(hits.device) + len(hits.host), room)
    if fetch_sources:
        hits.fetch = best_fetch(pools, pool, q, hits.num_local, fetch_sources, max_unsettled_steps)
    return hits


def best_fetch(pools: dict[PoolId, Pool], pool: Pool, q: PrefixQuery, num_local: int, sources: Iterable[PoolId],
               max_unsettled_steps: int) -> _fetch.FetchPlan | None:
    """The source pool among `sources` with the longest written prefix beyond `num_local`
    blocks — its device hits, then host-tier hits continuing them — (ties: pool id), and the
    blocks to fetch from it; None: nothing worth fetching."""
    best: tuple[Pool, list[int], list[int]] | None = None
    for sid in sorted(set(sources)):
        src = pools.get(sid)
        if (src is None or src is pool or src.block_size != pool.block_size
                or not _fetch.can_lend(src, max_unsettled_steps)):
            continue
        src_hits = device_hits(src, q, same_step=False)
        src_host = host_hits(src, q, len(src_hits))
        if best is None or len(src_hits) + len(src_host) > len(best[1]) + len(best[2]):
            best = (src, src_hits, src_host)
    return None if best is None else _fetch.plan(best[0], best[1], best[2], num_local)


def _lendable(pool: Pool, q: PrefixQuery, device: list[int], with_host: bool) -> int:
    """Blocks a fetch from `pool` could lend: its written device hits (not this open step's:
    `best_fetch`), then, `with_host`, host hits continuing them."""
    n = next((i for i, b in enumerate(device) if not pool.written(b)), len(device))
    return n + len(host_hits(pool, q, n)) if with_host else n


def route(pools: dict[PoolId, Pool], tokens: array, salt: str | None, fetch_sources: Seq[PoolId] | None,
          enable_prefix_caching: bool, max_unsettled_steps: int) -> list[RouteEntry]:
    """`BlockManager.route`: per pool that admits, its local prefix, what it could fetch from
    the best source, the rest; best first by the fetch cost model (`fetch.score`: tokens to
    recompute + fetched tokens / FETCH_SPEEDUP; so the longest local prefix still wins), then
    most free-or-evictable blocks, then pool id."""
    queries: dict[int, PrefixQuery] = {}
    hits: dict[PoolId, int] = {}        # device hits (a pool's local prefix)
    lendable: dict[PoolId, int] = {}    # a source's device hits + host hits continuing them
    sources = set(pools) if fetch_sources is None else set(fetch_sources) & set(pools)
    if enable_prefix_caching:
        for pool in pools.values():
            if pool.draining and pool.pool_id not in sources:
                continue
            q = queries.get(pool.block_size)
            if q is None:
                q = queries[pool.block_size] = PrefixQuery.of(tokens, pool.block_size, salt)
            device = device_hits(pool, q)
            hits[pool.pool_id] = len(device)
            lendable[pool.pool_id] = _lendable(pool, q, device, pool.pool_id in sources)
    entries = [_route_entry(pools, pool, len(tokens), hits.get(pool.pool_id, 0), lendable, sorted(sources),
                            max_unsettled_steps) for pool in pools.values() if not pool.draining]
    entries.sort(key=lambda e: (_fetch.score(len(tokens), e.num_cached_tokens, e.num_fetchable_tokens),
                                -e.num_free_blocks, e.pool_id))
    return entries


def _route_entry(pools: dict[PoolId, Pool], pool: Pool, num_tokens: int, local: int, lendable: dict[PoolId, int],
                 sources: list[PoolId], max_unsettled_steps: int) -> RouteEntry:
    best: PoolId | None = None
    for sid in sources:
        src = pools[sid]
        if (sid != pool.pool_id and src.block_size == pool.block_size
                and lendable.get(sid, 0) - local >= _fetch.MIN_FETCH_BLOCKS
                and _fetch.can_lend(src, max_unsettled_steps)
                and (best is None or lendable[sid] > lendable[best])):
            best = sid
    bs = pool.block_size
    fetchable = 0 if best is None else (lendable[best] - local) * bs
    return RouteEntry(pool.pool_id, local * bs, usable_blocks(pool), fetchable, num_tokens - local * bs - fetchable,
                      best)


def usable_blocks(pool: Pool) -> int:
    """Free, evictable, or held by a defrag plan no node has yet (which an allocation or
    swap-in that needs them aborts)."""
    return pool.num_available + _defrag.unsent_plan_blocks(pool)


__all__ = ["NO_HITS", "PrefixHits", "PrefixQuery", "best_fetch", "collect", "device_hits", "disk_hits", "host_hits",
           "route", "usable_blocks", "walk"]
