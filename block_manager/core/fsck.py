"""Invariant checker: every rule the bookkeeping must obey, reported as readable lines.

It walks the whole state (O(blocks + table entries)), so it is for tests, recovery
(`from_snapshot` refuses a state that fails it) and admin calls, not the hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from block_manager.core.block_tier import BlockMeta
from block_manager.core.disk_tier import DiskTier
from block_manager.core.fetch import fsck_loans, host_loan_holders, loan_holders
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence
from block_manager.core.tiers import DISK_KINDS, HostTier
from block_manager.core.types import PoolId, SeqId


def fsck(pools: Mapping[PoolId, Pool], seqs: Mapping[SeqId, Sequence], next_plan_id: int) -> list[str]:
    """Every violated invariant of the manager's parts (its pools, its sequence index and its
    next plan id), as readable lines; empty when healthy."""
    problems: list[str] = []
    seen_seqs: set[str] = set()
    for pool in pools.values():
        problems.extend(_check_pool(pool))
        for sid, seq in pool.seqs.items():
            seen_seqs.add(sid)
            if seqs.get(sid) is not seq:
                problems.append(f"sequence {sid!r} of pool {pool.pool_id!r} not in the manager")
    for sid, seq in seqs.items():
        if sid not in seen_seqs:
            problems.append(f"sequence {sid!r} belongs to no pool (pool {seq.pool_id!r})")
    plan_ids = [p.plan.plan_id for p in pools.values() if p.plan is not None]
    if len(set(plan_ids)) != len(plan_ids):
        problems.append(f"duplicate plan ids {plan_ids}")
    if any(pid >= next_plan_id for pid in plan_ids):
        problems.append("a plan id is not below next_plan_id")
    for pool in pools.values():
        problems.extend(fsck_host(pool, seqs))
    problems.extend(fsck_loans(dict(pools)))
    return problems


def _check_steps(pool: Pool) -> list[str]:
    """Step bookkeeping: ids in order, nothing written in the future, dirty tables live."""
    p = f"pool {pool.pool_id!r}: "
    out: list[str] = []
    open_id = pool.step.step_id
    ids = [r.step_id for r in pool.unsettled]
    if ids != sorted(set(ids)) or any(not pool.settled_step < i < open_id for i in ids):
        out.append(p + f"unsettled steps {ids} not strictly between settled {pool.settled_step} and open {open_id}")
    if ids and ids[-1] != open_id - 1:
        out.append(p + f"last unsettled step {ids[-1]} is not the last closed step {open_id - 1}")
    if not ids and pool.settled_step != open_id - 1:
        out.append(p + f"no unsettled step but settled {pool.settled_step} != last closed {open_id - 1}")
    if max(pool.write_step, default=0) > open_id:
        out.append(p + "a block was written in a step that is not open yet")
    last = 0
    for op in pool.step.copy_ops:
        if op.op_id <= last or op.op_id >= pool.next_op_id:
            out.append(p + f"copy op id {op.op_id} out of order or not below next_op_id {pool.next_op_id}")
        last = op.op_id
    for sid, d in pool.step.dirty.items():
        if sid not in pool.seqs:
            out.append(p + f"open step notes a table change of absent sequence {sid!r}")
        elif not d.created and any(i >= d.base_len for i in d.replaced):
            out.append(p + f"sequence {sid!r}: replaced positions beyond the step's base length")
    for sid, seq in pool.seqs.items():
        if seq.last_touched_step > open_id:
            out.append(p + f"sequence {sid!r} last written in future step {seq.last_touched_step}")
    plan = pool.plan
    if plan is not None and plan.step_id > open_id:
        out.append(p + f"plan {plan.plan_id} rides in future step {plan.step_id}")
    return out


def _check_pool(pool: Pool) -> list[str]:
    p = f"pool {pool.pool_id!r}: "
    out: list[str] = []
    n = pool.num_blocks
    for name, lst in (("free", pool.free_list), ("cached", pool.cached_list)):
        out.extend(p + f"{name} list: {msg}" for msg in lst.check())
    if pool.num_free + pool.num_cached + pool.num_used + pool.num_reserved != n:
        out.append(
            p + f"free {pool.num_free} + cached {pool.num_cached} + used {pool.num_used} + "
            f"reserved {pool.num_reserved} != {n}"
        )
    holders: Counter[int] = Counter()
    out.extend(_check_tables(pool, holders))
    for b, n_loans in loan_holders(pool).items():   # blocks lent to other pools' fetches
        holders[b] += n_loans
    out.extend(_check_blocks(pool, holders))
    out.extend(_check_steps(pool))
    if pool.last_defrag_step > pool.num_steps:
        out.append(p + "last_defrag_step is ahead of num_steps")
    return out


def _check_tables(pool: Pool, holders: Counter[int]) -> list[str]:
    """Each sequence's table, count, version and hash chain; counts the tables' blocks into
    `holders`."""
    p = f"pool {pool.pool_id!r}: "
    out: list[str] = []
    n = pool.num_blocks
    bs = pool.block_size
    for sid, seq in pool.seqs.items():
        s = f"{p}sequence {sid!r}: "
        if seq.pool_id != pool.pool_id:
            out.append(s + f"pinned to {seq.pool_id!r}")
        if seq.num_tokens < 1:
            out.append(s + f"num_tokens {seq.num_tokens}")
        if len(seq.block_table) != -(-seq.num_tokens // bs):
            out.append(s + f"{len(seq.block_table)} blocks for {seq.num_tokens} tokens")
        if not 1 <= seq.version <= pool.last_version:
            out.append(s + f"version {seq.version} outside 1..{pool.last_version} (the pool's counter)")
        for b in seq.block_table:
            if not 0 <= b < n:
                out.append(s + f"block id {b} out of range")
            else:
                holders[b] += 1
        late = seq.num_late
        if seq.hashing:
            # a full last block is hashed once its late ids (if any) arrived
            full = seq.num_tokens // bs - (1 if late and seq.num_tokens % bs == 0 else 0)
            if len(seq.block_hashes) != full:
                out.append(s + f"{len(seq.block_hashes)} block hashes for {seq.num_tokens} tokens"
                           + (f" ({late} late ids)" if late else ""))
            if len(seq.tail_token_ids) != seq.num_tokens - full * bs:
                out.append(s + f"{len(seq.tail_token_ids)} tail tokens for {seq.num_tokens} tokens")
            if not 0 <= late <= len(seq.tail_token_ids):
                out.append(s + f"{late} late ids for {len(seq.tail_token_ids)} tail tokens")
        elif seq.block_hashes or seq.tail_token_ids or late:
            out.append(s + "hashing is off but hashes/tail tokens/late ids are kept")
    return out


def _check_blocks(pool: Pool, holders: Counter[int]) -> list[str]:
    """Each block in exactly one place (free, cached, used or reserved), its ref count equal to
    its holders, the defrag plan's flags, and the prefix index."""
    p = f"pool {pool.pool_id!r}: "
    out: list[str] = []
    n = pool.num_blocks
    free = set(pool.free_list)
    cached = set(pool.cached_list)
    plan = pool.plan
    dsts = {op.dst for op in plan.moves} if plan else set()
    srcs = {op.src for op in plan.moves} if plan else set()
    num_used = 0
    for b in range(n):
        ref = pool.ref_cnt[b]
        if ref != holders.get(b, 0):
            out.append(p + f"block {b}: ref_cnt {ref} but held by {holders.get(b, 0)} tables")
        if ref:
            num_used += 1
        in_free, in_cached = b in free, b in cached
        if in_free and in_cached:
            out.append(p + f"block {b} in both the free and the cached list")
        if (in_free or in_cached) and ref:
            out.append(p + f"block {b} is queued as free but referenced")
        if (in_free or in_cached) and pool.reserved[b]:
            out.append(p + f"block {b} is queued as free but reserved")
        if not (in_free or in_cached or ref or pool.reserved[b]):
            out.append(p + f"block {b} is leaked (not free, cached, used or reserved)")
        if pool.reserved[b] and b not in dsts and not (b in srcs and ref == 0):
            out.append(p + f"block {b} reserved without a plan holding it")
        if b in dsts and (not pool.reserved[b] or ref):
            out.append(p + f"plan destination {b} not reserved or referenced")
        if pool.pinned[b] != (b in srcs):
            out.append(p + f"block {b}: pinned flag {pool.pinned[b]} disagrees with the plan")
        m = pool.meta[b]
        if in_cached and m is None:
            out.append(p + f"cached block {b} has no hash")
        if in_free and m is not None:
            out.append(p + f"free block {b} still has a hash")
        if m is not None:
            if pool.prefix_index.get(m.block_hash) != b:
                out.append(p + f"block {b}: its hash is not indexed to it")
            if len(m.token_ids) != pool.block_size:
                out.append(p + f"hashed block {b} holds {len(m.token_ids)} tokens")
    if num_used != pool.num_used:
        out.append(p + f"num_used {pool.num_used} but {num_used} blocks referenced")
    if sum(pool.reserved) != pool.num_reserved:
        out.append(p + f"num_reserved {pool.num_reserved} but {sum(pool.reserved)} flagged")
    for h, b in pool.prefix_index.items():
        m = pool.meta[b] if 0 <= b < n else None
        if m is None or m.block_hash != h:
            out.append(p + f"index entry {h.hex()[:12]}… → block {b} without that hash")
    return out


# ---- the host and disk tiers ----------------------------------------------------------------
def _same_content(a: BlockMeta | None, m: BlockMeta) -> bool:
    return a is None or (a.token_ids == m.token_ids and a.parent_hash == m.parent_hash and a.salt == m.salt)


def fsck_host(pool: Pool, live_ids: Mapping[SeqId, Sequence]) -> list[str]:
    """Invariants of a pool's host tier: every block in exactly one place (free queue, cached
    queue, or held), ref counts equal to swapped tables + holds + loans, no block both free
    and mapped, the index and the metadata agree, host and device indexes agree on content."""
    host = pool.host
    if host is None:
        return []
    p: list[str] = []
    name = f"pool {pool.pool_id!r} host"
    p.extend(f"{name} free list: {x}" for x in host.free_list.check())
    p.extend(f"{name} cached list: {x}" for x in host.cached_list.check())
    expected = [0] * host.num_blocks
    for rec in host.swapped.values():
        for h in set(rec.host_table):
            expected[h] += 1
        n_blocks = -(-rec.num_tokens // pool.block_size)
        if len(rec.host_table) != n_blocks:
            p.append(f"{name}: swapped {rec.seq_id!r} has {len(rec.host_table)} blocks for {rec.num_tokens} tokens")
    for _, h in host.holds:
        expected[h] += 1
    for h, n_loans in host_loan_holders(pool).items():   # pinned for another pool's fetch (fetch.py)
        expected[h] += n_loans
    for sid in host.swapped:
        if sid in live_ids:
            p.append(f"{name}: sequence {sid!r} is both swapped out and live")
    p.extend(_check_host_blocks(pool, host, expected, name))
    p.extend(_check_tier_ops(pool, host, name))
    if host.disk is not None:
        p.extend(_fsck_disk(pool, host, host.disk))
    return p


def _check_host_blocks(pool: Pool, host: HostTier, expected: list[int], name: str) -> list[str]:
    p: list[str] = []
    for b in range(host.num_blocks):
        in_free, in_cached = b in host.free_list, b in host.cached_list
        ref = host.ref_cnt[b]
        if ref != expected[b]:
            p.append(f"{name} block {b}: ref_cnt {ref}, held by {expected[b]}")
        places = int(in_free) + int(in_cached) + int(ref > 0)
        if places != 1:
            p.append(f"{name} block {b}: in {places} places (free={in_free} cached={in_cached} ref={ref})")
        m = host.meta[b]
        if in_free and m is not None:
            p.append(f"{name} block {b}: free but hashed")
        if in_cached and m is None:
            p.append(f"{name} block {b}: cached without a hash")
        if m is not None:
            if host.prefix_index.get(m.block_hash) != b:
                p.append(f"{name} block {b}: its hash is not indexed to it")
            d = pool.prefix_index.get(m.block_hash)
            if not _same_content(pool.meta[d] if d is not None else None, m):
                p.append(f"{name} block {b}: device block {d} has its hash with other content")
    if len(host.prefix_index) != sum(m is not None for m in host.meta):
        p.append(f"{name}: index and metadata disagree")
    return p


def _check_tier_ops(pool: Pool, host: HostTier, name: str) -> list[str]:
    p: list[str] = []
    disk = host.disk
    for op in pool.step.tier_ops:
        src_n, dst_n = (pool.num_blocks, host.num_blocks) if op.to_host else (host.num_blocks, pool.num_blocks)
        if op.kind in DISK_KINDS:
            n_disk = 0 if disk is None else disk.num_blocks
            src_n, dst_n = (host.num_blocks, n_disk) if op.kind == "disk_offload" else (n_disk, host.num_blocks)
        if not (0 <= op.src < src_n and 0 <= op.dst < dst_n):
            p.append(f"{name}: tier op {op} out of range")
    return p


def _fsck_disk(pool: Pool, host: HostTier, disk: DiskTier) -> list[str]:
    """Every slot in exactly one place (free, cached, or held), ref counts = holds, index
    and metadata agree, and a hash on disk names the same content as on host or device."""
    p: list[str] = []
    name = f"pool {pool.pool_id!r} disk"
    p.extend(f"{name} free list: {x}" for x in disk.free_list.check())
    p.extend(f"{name} cached list: {x}" for x in disk.cached_list.check())
    expected = [0] * disk.num_blocks
    for _, s in disk.holds:
        expected[s] += 1
    for s in range(disk.num_blocks):
        in_free, in_cached, ref = s in disk.free_list, s in disk.cached_list, disk.ref_cnt[s]
        if ref != expected[s]:
            p.append(f"{name} slot {s}: ref_cnt {ref}, held by {expected[s]}")
        if int(in_free) + int(in_cached) + int(ref > 0) != 1:
            p.append(f"{name} slot {s}: in {int(in_free) + int(in_cached) + int(ref > 0)} places")
        m = disk.meta[s]
        if in_free and m is not None:
            p.append(f"{name} slot {s}: free but hashed")
        if in_cached and m is None:
            p.append(f"{name} slot {s}: cached without a hash")
        if m is None:
            continue
        if disk.prefix_index.get(m.block_hash) != s:
            p.append(f"{name} slot {s}: its hash is not indexed to it")
        for tier, index, metas in (("device", pool.prefix_index, pool.meta), ("host", host.prefix_index, host.meta)):
            b = index.get(m.block_hash)
            if not _same_content(metas[b] if b is not None else None, m):
                p.append(f"{name} slot {s}: {tier} block {b} has its hash with other content")
    if len(disk.prefix_index) != sum(m is not None for m in disk.meta):
        p.append(f"{name}: index and metadata disagree")
    return p
