"""Prefix fetch between pools: the ledger of a transfer of another node's cached prefix blocks
instead of a recompute (docs/prefix_fetch.md).

An admission placed on pool D whose prompt prefix is cached further on pool S (a busy,
draining or otherwise unchosen node) gets, besides its local hits, *fetched* blocks: fresh
blocks of D whose content is copied from S's blocks node to node. Three records, all ops of
open steps (the one-sequencer rule, like tier moves and defrag moves):

- a `Loan` on S: S's source blocks — device blocks, then host-tier blocks continuing them —
  are pinned (one reference each) until D's step carrying the fetch is reported, done or
  failed: nothing of S can evict, reuse or move them meanwhile (a pool with loans takes no
  defrag plan; a pinned host block is not evictable);
- a `ServeGrant` in S's open step: the scheduler hands it to S's node in S's step, which then
  serves exactly those blocks to D's node for that fetch id (and nothing else);
- a `FetchOp` in D's open step: D's node pulls the blocks inside its step, before its Forward
  reads them. The op carries the fetched blocks' token ids, so when the pull fails (S died,
  a checksum mismatch, a timeout) the node recomputes exactly those positions in the same
  step instead: the table never points at unwritten memory either way.

D's fetched blocks are written by D's step like any computed block (`write_step`), and their
hashes are registered in that step: they become prefix hits on D only once the step is
reported complete, and a step reported failed drops the sequence and forgets the hashes
(the existing failure path) — the commit-on-report rule, with no half-written table.

The cost model that decides whether to fetch at all and which pool to place on is `score`
(see docs/prefix_fetch.md): tokens to recompute plus fetched tokens divided by
`FETCH_SPEEDUP`, then the pools' load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from block_manager.core.types import BlockId, PoolId, SeqId

Pool = Any   # block_manager.core.pool.Pool (pool.py imports this module)

# How many tokens' worth of recompute one fetched token costs, inverted: a fetched token counts
# 1 / FETCH_SPEEDUP of a recomputed one in placement. Measured by bench/bench_prefix_fetch.py
# on CPU nodes (a 2k-token prefix: the fetch is >10x cheaper than its prefill); kept at a
# conservative 4 so a pool with the prefix local still wins over fetching it elsewhere.
FETCH_SPEEDUP = 4
# Fewer fetchable blocks than this are recomputed: a transfer has a fixed cost (a stream set up
# between two nodes) that a block or two of prefill does not repay.
MIN_FETCH_BLOCKS = 2


@dataclass(slots=True, frozen=True)
class FetchOp:
    """Destination side (in D's step): pull `src_blocks` of `src_pool` into `dst_blocks`, for
    sequence `seq_id` whose positions `first_token …` they hold; `token_ids` are those
    positions' tokens, recomputed by the node when the pull fails."""

    fetch_id: str
    src_pool: PoolId
    src_blocks: tuple[BlockId, ...]
    dst_blocks: tuple[BlockId, ...]
    seq_id: SeqId
    first_token: int
    token_ids: tuple[int, ...]
    src_host: tuple[bool, ...] = ()   # per source block: in the source's host tier (empty: none)


@dataclass(slots=True, frozen=True)
class ServeGrant:
    """Source side (in S's step): serve `blocks` to `dst_pool`'s node for `fetch_id`."""

    fetch_id: str
    dst_pool: PoolId
    blocks: tuple[BlockId, ...]
    host: tuple[bool, ...] = ()   # per block: a host-tier block (empty: none)


@dataclass(slots=True)
class Loan:
    """Blocks of a source pool pinned for a fetch until `dst_pool` reports `dst_step`:
    device blocks, and host-tier blocks (their own id space)."""

    fetch_id: str
    dst_pool: PoolId
    dst_step: int
    blocks: list[int]
    host_blocks: list[int] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class FetchPlan:
    """What `allocate` decided to fetch for one admission."""

    src: Pool
    src_blocks: list[int]
    src_host: list[bool]


def fetch_id(dst_pool: str, step_id: int, seq_id: str) -> str:
    """Unique per fetch: a sequence id is admitted at most once per step of its pool."""
    return f"{dst_pool}/{step_id}/{seq_id}"


def score(num_tokens: int, num_local: int, num_fetchable: int) -> float:
    """The placement cost of a prompt on a pool, in recomputed-token units: what is neither
    local nor fetchable is recomputed, a fetched token costs 1 / FETCH_SPEEDUP."""
    return (num_tokens - num_local - num_fetchable) + num_fetchable / FETCH_SPEEDUP


def can_lend(pool: Pool, max_unsettled_steps: int) -> bool:
    """Whether `pool` may be a fetch source now: its grant must ride in a step it can close
    (below the unsettled limit) and no defrag plan may move its blocks meanwhile."""
    return pool.plan is None and not pool.step.reset and len(pool.unsettled) < max_unsettled_steps


def plan(src: Pool, src_hits: list[int], host_hits: list[int], num_local: int) -> FetchPlan | None:
    """The source blocks (device hits, then host hits continuing them) beyond a destination's
    `num_local` local blocks (None: too few)."""
    blocks = [*src_hits, *host_hits][num_local:]
    if len(blocks) < MIN_FETCH_BLOCKS:
        return None
    host = [i >= len(src_hits) for i in range(num_local, len(src_hits) + len(host_hits))]
    return FetchPlan(src, blocks, host)


def lend(src: Pool, dst_pool: PoolId, dst_step: int, fid: str, blocks: list[int], host: list[bool]) -> None:
    """Pin `blocks` of `src` for the fetch and queue the grant in `src`'s open step."""
    device_blocks = [b for b, h in zip(blocks, host) if not h]
    host_blocks = [b for b, h in zip(blocks, host) if h]
    for b in device_blocks:
        src.share_block(b)
    for b in host_blocks:
        src.host.share(b)
    src.lent[fid] = Loan(fid, dst_pool, dst_step, device_blocks, host_blocks)
    src.step.serves.append(ServeGrant(fid, dst_pool, tuple(BlockId(b) for b in blocks),
                                      tuple(host) if any(host) else ()))


def queue_fetch(dst: Pool, op: FetchOp) -> None:
    dst.step.fetches.append(op)
    dst.fetched_blocks += len(op.dst_blocks)


def repay(pools: dict[PoolId, Pool], dst_pool: PoolId, up_to_step: int) -> int:
    """`dst_pool` reported every step up to `up_to_step` (done or failed): the loans for its
    fetches in those steps end, their source blocks are unpinned. Returns how many ended."""
    n = 0
    for src in pools.values():
        if not src.lent:
            continue
        for fid in [f for f, loan in src.lent.items() if loan.dst_pool == dst_pool and loan.dst_step <= up_to_step]:
            loan = src.lent.pop(fid)
            for b in reversed(loan.blocks):
                src.release_block(b)
            for b in reversed(loan.host_blocks):
                src.host.release(b)
            n += 1
    return n


def loan_holders(pool: Pool) -> dict[int, int]:
    """References each block of `pool` has from loans (fsck counts them with the tables)."""
    out: dict[int, int] = {}
    for loan in pool.lent.values():
        for b in loan.blocks:
            out[b] = out.get(b, 0) + 1
    return out


def host_loan_holders(pool: Pool) -> dict[int, int]:
    """References each host-tier block of `pool` has from loans (fsck_host counts them)."""
    out: dict[int, int] = {}
    for loan in pool.lent.values():
        for b in loan.host_blocks:
            out[b] = out.get(b, 0) + 1
    return out


def fsck_loans(pools: dict[PoolId, Pool]) -> list[str]:
    """Every loan names a live destination whose step is not reported yet, and every fetch op
    of an open step has its loan."""
    p: list[str] = []
    for src in pools.values():
        for fid, loan in src.lent.items():
            dst = pools.get(loan.dst_pool)
            if dst is None:
                p.append(f"pool {src.pool_id!r}: loan {fid} to a pool that is gone ({loan.dst_pool!r})")
            elif loan.dst_step <= dst.settled_step:
                p.append(f"pool {src.pool_id!r}: loan {fid} outlived its step {loan.dst_step} "
                         f"(settled up to {dst.settled_step})")
            if any(not 0 <= b < src.num_blocks for b in loan.blocks):
                p.append(f"pool {src.pool_id!r}: loan {fid} names a block outside the pool")
            if loan.host_blocks and (src.host is None or any(not 0 <= b < src.host.num_blocks
                                                             for b in loan.host_blocks)):
                p.append(f"pool {src.pool_id!r}: loan {fid} names a host block outside its host tier")
    for dst in pools.values():
        for op in dst.step.fetches:
            src = pools.get(op.src_pool)
            if src is not None and op.fetch_id not in src.lent:
                p.append(f"pool {dst.pool_id!r}: fetch {op.fetch_id} without its loan on {op.src_pool!r}")
    return p


# ---- snapshot ---------------------------------------------------------------------------------
def loans_to_list(pool: Pool) -> list[list[Any]]:
    return [[loan.fetch_id, loan.dst_pool, loan.dst_step, list(loan.blocks), list(loan.host_blocks)]
            for loan in pool.lent.values()]


def loans_from_list(data: list[list[Any]]) -> dict[str, Loan]:
    return {str(d[0]): Loan(str(d[0]), PoolId(str(d[1])), int(d[2]), [int(b) for b in d[3]],
                            [int(b) for b in d[4]] if len(d) > 4 else []) for d in data}


def fetch_to_list(op: FetchOp) -> list[Any]:
    return [op.fetch_id, op.src_pool, list(op.src_blocks), list(op.dst_blocks), op.seq_id, op.first_token,
            list(op.token_ids), list(op.src_host)]


def fetch_from_list(d: list[Any]) -> FetchOp:
    fid, src, sb, db, sid, first, tokens = d[:7]
    return FetchOp(str(fid), PoolId(str(src)), tuple(BlockId(int(b)) for b in sb), tuple(BlockId(int(b)) for b in db),
                   SeqId(str(sid)), int(first), tuple(int(t) for t in tokens),
                   tuple(bool(h) for h in d[7]) if len(d) > 7 else ())


def grant_to_list(g: ServeGrant) -> list[Any]:
    return [g.fetch_id, g.dst_pool, list(g.blocks), list(g.host)]


def grant_from_list(d: list[Any]) -> ServeGrant:
    fid, dst, blocks = d[:3]
    return ServeGrant(str(fid), PoolId(str(dst)), tuple(BlockId(int(b)) for b in blocks),
                      tuple(bool(h) for h in d[3]) if len(d) > 3 else ())


__all__ = ["FETCH_SPEEDUP", "MIN_FETCH_BLOCKS", "FetchOp", "FetchPlan", "Loan", "ServeGrant", "fetch_id", "score"]
