"""Gauges and counters of a pool and its tiers, as the service exports them (read-only)."""

from __future__ import annotations

from block_manager.core import defrag as _defrag
from block_manager.core.pool import Pool
from block_manager.core.types import DiskTierMetrics, HostTierMetrics, PoolMetrics


def pool_metrics(pool: Pool) -> PoolMetrics:
    bs = pool.block_size
    num_tokens = 0
    partial: dict[int, int] = {}
    for seq in pool.seqs.values():
        num_tokens += seq.num_tokens
        fill = seq.num_tokens % bs
        if fill:
            partial[seq.block_table[-1]] = fill
    waste = sum(bs - fill for fill in partial.values())
    return PoolMetrics(
        pool_id=pool.pool_id,
        num_blocks=pool.num_blocks,
        block_size=bs,
        num_free_blocks=pool.num_free,
        num_used_blocks=pool.num_used,
        num_cached_blocks=pool.num_cached,
        num_reserved_blocks=pool.num_reserved,
        usage=pool.num_used / pool.num_blocks,
        high_water_mark=pool.high_water_mark(),
        num_tokens=num_tokens,
        allocated_slots=pool.num_used * bs,
        waste_slots=waste,
        prefix_query_tokens=pool.prefix_query_tokens,
        prefix_hit_tokens=pool.prefix_hit_tokens,
        cow_copies=pool.cow_copies,
        evictions=pool.evictions,
        defrag_moves=pool.defrag_moves,
        compaction_plans=pool.compaction_plans,
        contiguity_plans=pool.contiguity_plans,
        aborted_plans=pool.aborted_plans,
        num_sequences=len(pool.seqs),
        contiguity=_defrag.contiguity_score(pool),
    )


def host_metrics(pool: Pool) -> HostTierMetrics | None:
    """The pool's host tier counters and gauges (None: the pool has no host tier)."""
    host = pool.host
    if host is None:
        return None
    return HostTierMetrics(
        pool.pool_id, host.num_blocks, host.free_list.length, host.cached_list.length,
        host.num_blocks - host.num_available, len(host.swapped), **host.counters(),
    )


def disk_metrics(pool: Pool) -> DiskTierMetrics | None:
    """The pool's disk tier counters and gauges (None: the pool has no disk tier)."""
    disk = None if pool.host is None else pool.host.disk
    if disk is None:
        return None
    return DiskTierMetrics(pool.pool_id, disk.num_blocks, disk.free_list.length, disk.cached_list.length,
                           **disk.counters())


__all__ = ["disk_metrics", "host_metrics", "pool_metrics"]
