"""The batched append: one call per scheduler step for every running sequence.

This is the hot path (256 decode appends must take well under a millisecond), so the
loop is written flat: one dict lookup per sequence, integer arithmetic for the common
case of a token landing inside the last block, shared empty tuples for "no new block"
and "no copy", and hashing only when a block actually fills up.

Every append is recorded in its pool's open step (steps.py): the blocks that receive slots
get `write_step` = the open step, tables that gain or replace a block are noted for the step's
deltas. `already_written=True` reports tokens a scheduler wrote before telling the block
manager (in-block decode appends it answered locally): they get slots like any append, but
they were written by Forwards that are already complete, so nothing of the step changes and
no block may be added or filled by them.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence as Seq
from typing import cast

from block_manager.core.errors import InvalidRequest, OutOfBlocks, PendingWrite, UnknownSequence
from block_manager.core.hashing import hash_block_bytes, salt_bytes
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence
from block_manager.core.slots import slot_range
from block_manager.core.steps import touch
from block_manager.core.types import AppendFailure, AppendRequest, AppendResult, PoolId, SeqId

_EMPTY: tuple = ()
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _failure(
    seqs: dict[SeqId, Sequence],
    pools: dict[PoolId, Pool],
    seen: set[SeqId],
    req: AppendRequest,
    already_written: bool = False,
) -> AppendFailure | None:
    """The error for a request, or None when it is valid (the slow, precise path)."""
    sid = req.seq_id
    n = req.num_new_tokens
    toks = req.token_ids
    seq = seqs.get(sid)
    if seq is None:
        return AppendFailure(sid, UnknownSequence(f"unknown sequence {sid!r}"))
    if sid in seen:
        return AppendFailure(sid, InvalidRequest(f"sequence {sid!r} appears twice in one batch"))
    if type(n) is not int or n <= 0:
        return AppendFailure(
            sid, InvalidRequest(f"num_new_tokens must be a positive int, got {n!r}")
        )
    if toks is not None:
        if len(toks) != n:
            return AppendFailure(sid, InvalidRequest(f"{len(toks)} token ids for {n} new tokens"))
        for t in toks:
            try:
                value = operator.index(t)
            except TypeError:
                value = None
            if value is None or isinstance(t, bool) or not _INT64_MIN <= value <= _INT64_MAX:
                return AppendFailure(sid, InvalidRequest(f"token id {t!r} is not an int64 integer"))
    pool = pools[seq.pool_id]
    bs = pool.block_size
    table = seq.block_table
    off = seq.num_tokens % bs
    if already_written and (off == 0 or off + n >= bs or pool.ref_cnt[table[-1]] > 1):
        return AppendFailure(
            sid,
            InvalidRequest(
                f"sequence {sid!r}: {n} already-written tokens must lie inside its exclusive, partial "
                f"last block ({off} of {bs} slots used)"
            ),
        )
    needed = (seq.num_tokens + n + bs - 1) // bs - len(table)
    if off and pool.ref_cnt[table[-1]] > 1:
        needed += 1
        if not pool.written(table[-1]):
            return AppendFailure(sid, _pending(seq, table[-1], pool))
    if needed > pool.num_available:
        return AppendFailure(
            sid,
            OutOfBlocks(
                f"pool {seq.pool_id!r}: sequence {sid!r} needs {needed} blocks, "
                f"{pool.num_available} available"
            ),
        )
    return None


def _pending(seq: Sequence, block: int, pool: Pool) -> PendingWrite:
    return PendingWrite(
        f"sequence {seq.seq_id!r}: copy-on-write of block {block}, written in step {pool.write_step[block]} "
        f"whose Forward is not reported yet (settled up to step {pool.settled_step})"
    )


def _hash_full_blocks(pool: Pool, seq: Sequence) -> None:
    """Hash and register every block the tail has filled (chained on the previous one)."""
    bs = pool.block_size
    tail = seq.tail_token_ids
    salt_enc = salt_bytes(seq.salt)
    hashes = seq.block_hashes
    while len(tail) >= bs:
        block_tokens = tuple(tail[:bs])
        del tail[:bs]
        parent = hashes[-1] if hashes else None
        h = hash_block_bytes(parent, array("q", block_tokens), salt_enc)
        b = seq.block_table[len(hashes)]
        if pool.register(b, h, parent, seq.salt, block_tokens):
            pool.step.registrations.append((b, h))
        hashes.append(h)


def append_batch(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    requests: Seq[AppendRequest],
    already_written: bool = False,
) -> list[AppendResult | AppendFailure]:
    """Append slots for a batch of sequences; see `BlockManager.append_slots`."""
    results: list[AppendResult | AppendFailure] = []
    append = results.append
    seen: set[SeqId] = set()
    seen_add = seen.add
    get_seq = seqs.get
    touched: dict[PoolId, Pool] = {}
    last_pool: Pool | None = None
    last_touched: Pool | None = None
    for req in requests:
        sid = req.seq_id
        seq = get_seq(sid)
        n = req.num_new_tokens
        toks = req.token_ids
        # Cheap screen for the common valid request; anything odd takes the precise path.
        bad = already_written or seq is None or sid in seen or type(n) is not int or n <= 0
        if not bad and toks is not None:
            if len(toks) != n:
                bad = True
            else:
                for t in toks:
                    if type(t) is not int or not _INT64_MIN <= t <= _INT64_MAX:
                        bad = True
                        break
        if bad:
            failure = _failure(seqs, pools, seen, req, already_written)
            if seq is not None:
                seen_add(sid)
            if failure is not None:
                append(failure)
                continue
            # Valid after all: integer-like token ids (e.g. numpy ints) become plain ints.
            if toks is not None:
                toks = tuple(operator.index(t) for t in toks)
        else:
            seen_add(sid)
        seq = cast(Sequence, seq)  # a missing sequence always fails above
        pool = pools[seq.pool_id]
        if pool is not last_pool:
            last_pool = pool
            step = pool.step
            step_id = step.step_id
            write_step = pool.write_step
        bs = pool.block_size
        table = seq.block_table
        old = seq.num_tokens
        new = old + n
        off = old % bs
        if off and n + off <= bs and pool.ref_cnt[table[-1]] == 1:
            # Inside an unshared partial block: no block, no copy, same table.
            b = table[-1]
            seq.num_tokens = new
            base = b * bs + off
            slots: tuple[int, ...] = (base,) if n == 1 else tuple(range(base, base + n))
            copy_ops: tuple = _EMPTY
            new_block_ids: tuple = _EMPTY
            if not already_written:
                write_step[b] = step_id
                seq.last_step = seq.last_write_step = step_id
                step.has_writes = True
        else:
            num_new_blocks = (new + bs - 1) // bs - len(table)
            cow = off != 0 and pool.ref_cnt[table[-1]] > 1
            if num_new_blocks + cow > pool.num_available:
                append(AppendFailure(sid, OutOfBlocks(
                    f"pool {seq.pool_id!r}: sequence {sid!r} needs {num_new_blocks + cow} "
                    f"blocks, {pool.num_available} available"
                )))
                continue
            if cow and write_step[table[-1]] > pool.settled_step:
                append(AppendFailure(sid, _pending(seq, table[-1], pool)))
                continue
            copy_ops = _EMPTY
            new_block_ids = _EMPTY
            dirty = touch(step, seq)
            if cow:
                src = table[-1]
                dst = pool.take_block()
                table[-1] = dst
                pool.release_block(src)
                copy_ops = (pool.add_copy_op(src, dst, "cow"),)
                pool.cow_copies += 1
                if len(table) - 1 < dirty.base_len and not dirty.created:
                    dirty.replaced.add(len(table) - 1)
            if num_new_blocks == 1:
                b = pool.take_block()
                table.append(b)
                new_block_ids = (b,)
            elif num_new_blocks:
                take = pool.take_block
                fresh = [take() for _ in range(num_new_blocks)]
                table.extend(fresh)
                new_block_ids = tuple(fresh)
            seq.version = pool.new_version()
            seq.num_tokens = new
            seq.last_step = seq.last_write_step = step_id
            step.has_writes = True
            for i in range(old // bs, len(table)):
                write_step[table[i]] = step_id
            if n == 1:
                slots = (table[old // bs] * bs + off,)
            else:
                slots = slot_range(table, bs, old, new)
        if pool is not last_touched:
            touched[seq.pool_id] = last_touched = pool
        if seq.hashing:
            if toks is None:
                # Content unknown from here on: the chain cannot continue.
                seq.hashing = False
                seq.tail_token_ids = []
                seq.block_hashes = []
            else:
                tail = seq.tail_token_ids
                tail.extend(toks)
                if len(tail) >= bs:
                    _hash_full_blocks(pool, seq)
        append(AppendResult(sid, slots, new_block_ids, copy_ops, seq.version, new))
    for pool in touched.values():
        pool.num_steps += 1
    return results
