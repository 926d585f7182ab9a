"""A sequence's life: `BlockManager.allocate` (validate → collect the prefix hits → check the
room → commit), `fork` and `free`. The hits are found along the prefix chain (prefix.py); this module checks
the request and the room and commits: the sequence takes its prompt's prefix hits and fresh
blocks for the rest, all recorded in the pool's open step.

Admission keeps `watermark * num_blocks` free-or-evictable blocks in reserve for running
sequences' appends. When every block of the prompt is cached, the last block is still
computed (num_cached_tokens <= num_tokens - 1): the model needs at least one query token to
produce the next token's logits, and recomputing a whole block keeps the slot mapping
block-aligned. With `num_compute` (chunked prefill) the prefix lookup still sees the whole
prompt, the sequence holds `num_cached_tokens + min(num_compute, rest)` tokens, and the
scheduler appends the rest of the prompt (with its token ids) in later steps. Fetched blocks
(another pool's, fetch.py) come from the source with the longest prefix and count as cached.

The commit's order matters, and is why it is one place:
1. the hits are pinned first — device hits shared, host hits referenced, disk hits held —
   because taking fresh blocks may evict: a device eviction offloads to host and a host
   eviction spills to disk, either of which could otherwise take the very blocks the prompt
   hit;
2. disk hits are staged into fresh host blocks (disk→host moves) before any device block is
   taken;
3. the fresh device blocks are taken, and the host hits and staged blocks are onboarded into
   the first of them (host→device moves, which run before the step's copies: so those first
   blocks are never ones the copies still name, step_order.py);
4. another pool's blocks are lent for the fetched part (fetch.py);
5. the prompt's full blocks beyond the device hits are registered in the prefix index, in
   the open step (a failure of the step unregisters them).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from block_manager.core import defrag as _defrag
from block_manager.core import fetch as _fetch
from block_manager.core.errors import (
    InvalidRequest,
    OutOfBlocks,
    PendingWrite,
    PoolDraining,
    SequenceExists,
    check_count,
)
from block_manager.core.hashing import token_array
from block_manager.core.pool import Pool
from block_manager.core.prefix import PrefixHits, PrefixQuery
from block_manager.core.sequence import Sequence, late_pending
from block_manager.core.step_order import BlockTaker, busy_blocks, early_room
from block_manager.core.step_work import note_created
from block_manager.core.steps import drop_sequence
from block_manager.core.swap import find_sequence, swapped_pool
from block_manager.core.types import BlockId, PoolId, SeqId, SequenceView


def check_new_id(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_id: SeqId) -> None:
    """`InvalidRequest` for a malformed id, `SequenceExists` for a live or swapped-out one."""
    if not isinstance(seq_id, str) or not seq_id:
        raise InvalidRequest(f"sequence id must be a non-empty string, got {seq_id!r}")
    if seq_id in seqs or swapped_pool(pools, seq_id) is not None:
        raise SequenceExists(f"sequence {seq_id!r} already exists")


def check_request(pool: Pool, token_ids: Seq[int] | None, num_tokens: int | None, salt: str | None,
                  num_compute: int | None, enable_prefix_caching: bool) -> tuple[PrefixQuery | None, int]:
    """Validate an allocation's prompt (nothing changes; the id and the pool are checked
    first): its prefix query (None: no hashing) and its length."""
    if pool.draining:
        raise PoolDraining(f"pool {pool.pool_id!r} is draining")
    if (token_ids is None) == (num_tokens is None):
        raise InvalidRequest("give exactly one of token_ids and num_tokens")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequest(f"salt must be a string or None, got {type(salt).__name__}")
    if num_compute is not None:
        check_count("num_compute", num_compute, 1)
    tokens = token_array(token_ids) if token_ids is not None else None
    prompt_len = len(tokens) if tokens is not None else check_count("num_tokens", num_tokens, 1)
    if prompt_len == 0:
        raise InvalidRequest("empty prompt")
    if tokens is None or not enable_prefix_caching:
        return None, prompt_len
    return PrefixQuery.of(tokens, pool.block_size, salt), prompt_len


def check_room(pool: Pool, hits: PrefixHits, num_new: int, reserve: int) -> None:
    """`OutOfBlocks` unless `num_new` fresh blocks fit above the `reserve` (the watermark) once
    the hits are taken; aborts a defrag plan no node has yet when that makes room enough. The
    first fresh blocks receive the host and disk hits by host→device moves, which the node runs
    before the step's copies: for those, blocks the copies still name do not count
    (step_order.py)."""
    queued = [b for b in hits.device if pool.ref_cnt[b] == 0]
    num_early = len(hits.host) + len(hits.disk)
    busy = busy_blocks(pool.step) if num_early else set()

    def fits(reclaim: bool) -> bool:
        extra = _defrag.unsent_plan_blocks(pool) if reclaim else 0
        if num_new > pool.num_available + extra - len(queued) - reserve:
            return False
        return num_early <= early_room(pool, busy, queued, reclaim) if num_early else True

    if fits(False):
        return
    if fits(True):
        _defrag.reclaim_unsent_plan(pool)   # all or nothing: only when it makes room enough
        return
    available = pool.num_available - len(queued) - reserve
    early = f" ({num_early} of them moved in from host before the open step's copies)" if num_early else ""
    raise OutOfBlocks(
        f"pool {pool.pool_id!r}: {num_new} blocks needed{early}, {max(available, 0)} available "
        f"above the watermark"
    )


def _stage(pool: Pool, slots: list[int]) -> list[int]:
    """Queue disk→host moves of held disk hits into fresh host blocks (the caller counted the
    room); returns the host blocks, each referenced once (the onboard turns that reference
    into a hold of the step). A staged block joins the host index (written once the step is
    reported) so the next prompt hits it on host."""
    host = pool.host
    disk = None if host is None else host.disk
    if host is None or disk is None:
        raise InvalidRequest(f"internal: pool {pool.pool_id!r} stages disk hits without a disk tier")
    step_id = pool.step.step_id
    out: list[int] = []
    for s in slots:
        h = host.take()
        if h is None:   # disk_hits capped the hits by the room: unreachable unless misused
            raise InvalidRequest("internal: host tier exhausted while staging disk hits")
        meta = disk.meta[s]
        if meta is not None and meta.block_hash not in host.prefix_index:
            host.index(h, meta)
        host.write_step[h] = step_id
        pool.queue_tier_op("disk_onboard", s, h)
        out.append(h)
    disk.disk_onboarded_blocks += len(slots)
    disk.disk_hit_tokens += len(slots) * pool.block_size
    return out


def _onboard(pool: Pool, host_blocks: list[int], device_blocks: list[int], count_hits: bool) -> None:
    """Queue host→device copies of referenced host blocks into fresh device blocks; each host
    block's reference becomes a hold of the open step (released when it is reported)."""
    host = pool.host
    if host is None:
        raise InvalidRequest(f"internal: pool {pool.pool_id!r} onboards without a host tier")
    step_id = pool.step.step_id
    for h, d in zip(host_blocks, device_blocks):
        pool.queue_tier_op("onboard", h, d)
        host.holds.append((step_id, h))
    host.onboarded_blocks += len(host_blocks)
    if count_hits:   # blocks staged from disk count as disk hits (`_stage`)
        host.host_hit_tokens += len(host_blocks) * pool.block_size


def take_blocks(pool: Pool, hits: PrefixHits, num_new: int) -> list[int]:
    """The new table: the device hits, then `num_new` fresh blocks, the first of which receive
    the host and disk hits (steps 1-3 of the module docstring)."""
    for b in hits.device:
        pool.share_block(b)
    host = pool.host
    staged: list[int] = []
    if host is not None:
        for h in hits.host:
            host.share(h)
        if hits.disk and host.disk is not None:
            step_id = pool.step.step_id
            for s in hits.disk:
                host.disk.hold(s, step_id)
            staged = _stage(pool, hits.disk)   # host blocks, taken before any device block
    n_dev = len(hits.device)
    # the blocks moved in from host come first, never one the open step's copies still name
    # (check_room counted the room for them); the rest are only written by the Forward
    num_early = len(hits.host) + len(staged)
    taker = BlockTaker(pool, busy_blocks(pool.step) if num_early else set())
    early = [taker.take() for _ in range(num_early)]
    taker.done()
    num_rest = num_new - num_early
    # the rest in one pop when the plain free list has them (the same blocks, in the same order)
    rest = (pool.take_free_many(num_rest) if num_rest <= pool.free_list.length
            else [pool.take_block() for _ in range(num_rest)])
    table = hits.device + early + rest
    if hits.host:
        _onboard(pool, hits.host, table[n_dev:n_dev + len(hits.host)], count_hits=True)
    if staged:
        first = n_dev + len(hits.host)
        _onboard(pool, staged, table[first:first + len(staged)], count_hits=False)
    return table


def _lend(pool: Pool, plan: _fetch.FetchPlan, seq_id: SeqId, first: int, table: list[int], q: PrefixQuery) -> None:
    """Blocks `first …` of the table are fetched from `plan.src`: its blocks lent, the pull
    queued in this pool's open step with the tokens to recompute should it fail."""
    bs = pool.block_size
    num = len(plan.src_blocks)
    step_id = pool.step.step_id
    fid = _fetch.fetch_id(pool.pool_id, step_id, seq_id)
    _fetch.lend(plan.src, pool.pool_id, step_id, fid, plan.src_blocks, plan.src_host)
    _fetch.queue_fetch(pool, _fetch.FetchOp(
        fid, plan.src.pool_id, tuple(BlockId(b) for b in plan.src_blocks),
        tuple(BlockId(b) for b in table[first:first + num]), seq_id, first * bs,
        tuple(q.tokens[first * bs:(first + num) * bs].tolist()),
        tuple(plan.src_host) if any(plan.src_host) else (),
    ))


def _register(pool: Pool, seq: Sequence, q: PrefixQuery, num_hits: int, prompt_len: int) -> None:
    """Make the prompt's full blocks beyond the `num_hits` device hits findable (in the open
    step), and give the sequence its hash chain and tail."""
    bs = pool.block_size
    step = pool.step
    table, hashes, tokens = seq.block_table, q.hashes, q.tokens
    parent = q.parent(num_hits)
    for i in range(num_hits, len(hashes)):
        if pool.register(table[i], hashes[i], parent, q.salt, tuple(tokens[i * bs: (i + 1) * bs])):
            step.registrations.append((table[i], hashes[i]))
        parent = hashes[i]
    seq.block_hashes = hashes
    seq.tail_token_ids = tokens[len(hashes) * bs:].tolist()
    pool.prefix_query_tokens += prompt_len
    pool.prefix_hit_tokens += num_hits * bs


def admit(pool: Pool, seq_id: SeqId, q: PrefixQuery | None, hits: PrefixHits, num_tokens: int, num_new: int,
          salt: str | None, prompt_len: int) -> Sequence:
    """Create the sequence of `num_tokens` tokens (the caller checked the room): its blocks,
    moves, fetch and registrations recorded in the open step. `q` None: no hashing."""
    table = take_blocks(pool, hits, num_new)
    if hits.fetch is not None and q is not None:
        _lend(pool, hits.fetch, seq_id, hits.num_local, table, q)
    step = pool.step
    # the pool's own id object: the batched append tells pools apart by identity
    seq = Sequence(seq_id, pool.pool_id, table, num_tokens, pool.new_version(), salt, q is not None, cols=pool.cols)
    step.has_writes = True
    seq.last_step = seq.last_write_step = step.step_id
    for b in table[len(hits.device):]:
        pool.write_step[b] = step.step_id
    if q is not None:
        _register(pool, seq, q, len(hits.device), prompt_len)
    pool.seqs[seq_id] = seq
    note_created(step, seq, hits.num_cached * pool.block_size)
    return seq


def fork(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], src: Sequence,
         child_ids: Seq[SeqId]) -> list[SequenceView]:
    """`BlockManager.fork`: children sharing every block of `src`, announced in the open step."""
    children = list(child_ids)
    if not children:
        raise InvalidRequest("fork needs at least one child id")
    if len(set(children)) != len(children):
        raise InvalidRequest("duplicate child ids")
    for cid in children:
        check_new_id(pools, seqs, cid)
    pool = pools[src.pool_id]
    if pool.draining:
        raise PoolDraining(f"pool {src.pool_id!r} is draining")
    if (pending := late_pending(src)) is not None:   # the children would inherit placeholders
        raise pending
    views: list[SequenceView] = []
    step = pool.step
    for cid in children:
        for b in src.block_table:
            pool.share_block(b)
        child = Sequence(
            cid, src.pool_id, list(src.block_table), src.num_tokens, pool.new_version(), src.salt,
            src.hashing, list(src.tail_token_ids), list(src.block_hashes),
            # A child's table is announced in this step: if the step fails the node never
            # learns it (and the parent's unsettled writes are the child's too).
            last_step=step.step_id, cols=pool.cols,
        )
        seqs[cid] = child
        pool.seqs[cid] = child
        note_created(step, child, src.num_tokens)
        views.append(child.view())
    return views


def check_can_free(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_id: SeqId) -> None:
    """`BlockManager.check_can_free`."""
    if seq_id not in seqs and swapped_pool(pools, seq_id) is not None:
        return   # swapped out: nothing to write, its host blocks go at once
    seq = find_sequence(pools, seqs, seq_id)
    open_id = pools[seq.pool_id].step.step_id
    if seq.last_write_step == open_id:
        raise PendingWrite(
            f"sequence {seq_id!r} has tokens to write in open step {open_id} of pool {seq.pool_id!r}; "
            "close the step and run its Forward before freeing it"
        )


def free(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_ids: Seq[SeqId]) -> None:
    """`BlockManager.free`: validate every id, then release them in order."""
    ids = list(seq_ids)
    if len(set(ids)) != len(ids):
        raise InvalidRequest("duplicate sequence ids in free")
    for sid in ids:
        check_can_free(pools, seqs, sid)
    for sid in ids:
        seq = seqs.get(sid)
        if seq is not None:
            drop_sequence(seqs, pools[seq.pool_id], sid)
            continue
        host_pool = swapped_pool(pools, sid)
        if host_pool is not None and host_pool.host is not None:
            host_pool.host.drop_swapped(sid)   # a swapped-out sequence frees its host blocks


__all__ = ["admit", "check_can_free", "free", "check_new_id", "check_request", "check_room", "fork", "take_blocks"]
