"""The batched append: one call per scheduler step for every running sequence.

This is the hot path (256 decode appends must take well under a millisecond), so the
loop is written flat: one dict lookup per sequence, integer arithmetic for the common
case of a token landing inside the last block, shared empty tuples for "no new block"
and "no copy", and hashing only when a block actually fills up.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence as Seq
from typing import cast

from block_manager.core.errors import InvalidRequest, OutOfBlocks, UnknownSequence
from block_manager.core.hashing import hash_block_bytes, salt_bytes
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence
from block_manager.core.slots import slot_range
from block_manager.core.types import AppendFailure, AppendRequest, AppendResult, PoolId, SeqId

_EMPTY: tuple = ()
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _failure(
    seqs: dict[SeqId, Sequence], pools: dict[PoolId, Pool], seen: set[SeqId], req: AppendRequest
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
    needed = (seq.num_tokens + n + bs - 1) // bs - len(table)
    if seq.num_tokens % bs and pool.ref_cnt[table[-1]] > 1:
        needed += 1
    if needed > pool.num_available:
        return AppendFailure(
            sid,
            OutOfBlocks(
                f"pool {seq.pool_id!r}: sequence {sid!r} needs {needed} blocks, "
                f"{pool.num_available} available"
            ),
        )
    return None


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
        pool.register(seq.block_table[len(hashes)], h, parent, seq.salt, block_tokens)
        hashes.append(h)


def append_batch(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    requests: Seq[AppendRequest],
) -> list[AppendResult | AppendFailure]:
    """Append slots for a batch of sequences; see `BlockManager.append_slots`."""
    results: list[AppendResult | AppendFailure] = []
    append = results.append
    seen: set[SeqId] = set()
    seen_add = seen.add
    get_seq = seqs.get
    touched: dict[PoolId, Pool] = {}
    last_pool: Pool | None = None
    for req in requests:
        sid = req.seq_id
        seq = get_seq(sid)
        n = req.num_new_tokens
        toks = req.token_ids
        # Cheap screen for the common valid request; anything odd takes the precise path.
        bad = seq is None or sid in seen or type(n) is not int or n <= 0
        if not bad and toks is not None:
            if len(toks) != n:
                bad = True
            else:
                for t in toks:
                    if type(t) is not int or not _INT64_MIN <= t <= _INT64_MAX:
                        bad = True
                        break
        if bad:
            failure = _failure(seqs, pools, seen, req)
            if seq is not None:
                seen_add(sid)
            if failure is not None:
                append(failure)
                continue
            # Valid after all: integer-like token ids (e.g. numpy ints) become plain ints.
            toks = tuple(operator.index(t) for t in toks)  # type: ignore[union-attr]
        else:
            seen_add(sid)
        seq = cast(Sequence, seq)  # a missing sequence always fails above
        pool = pools[seq.pool_id]
        bs = pool.block_size
        table = seq.block_table
        old = seq.num_tokens
        new = old + n
        off = old % bs
        if n == 1 and off and pool.ref_cnt[table[-1]] == 1:
            # Decode inside an unshared partial block: no block, no copy, same table.
            seq.num_tokens = new
            slots: tuple[int, ...] = (table[-1] * bs + off,)
            copy_ops: tuple = _EMPTY
            new_block_ids: tuple = _EMPTY
        else:
            num_new_blocks = (new + bs - 1) // bs - len(table)
            cow = off != 0 and pool.ref_cnt[table[-1]] > 1
            if num_new_blocks + cow > pool.num_available:
                append(AppendFailure(sid, OutOfBlocks(
                    f"pool {seq.pool_id!r}: sequence {sid!r} needs {num_new_blocks + cow} "
                    f"blocks, {pool.num_available} available"
                )))
                continue
            copy_ops = _EMPTY
            new_block_ids = _EMPTY
            if cow:
                src = table[-1]
                dst = pool.take_block()
                table[-1] = dst
                pool.release_block(src)
                copy_ops = (pool.add_copy_op(src, dst, "cow"),)
                pool.cow_copies += 1
            if num_new_blocks == 1:
                b = pool.take_block()
                table.append(b)
                new_block_ids = (b,)
            elif num_new_blocks:
                take = pool.take_block
                fresh = [take() for _ in range(num_new_blocks)]
                table.extend(fresh)
                new_block_ids = tuple(fresh)
            if cow or num_new_blocks:
                seq.version = pool.new_version()
            seq.num_tokens = new
            if n == 1:
                slots = (table[old // bs] * bs + off,)
            else:
                slots = slot_range(table, bs, old, new)
        if pool is not last_pool:
            touched[seq.pool_id] = last_pool = pool
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
