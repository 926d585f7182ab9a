"""The batched append: one call per scheduler step for every running sequence.

This is the hot path, so it is columnar: parallel lists of sequence ids and token counts and
one flat list of token ids (what the Step RPC carries), answered with one list of token
counts. The batch is screened as a whole with C-level operations (types, ranges, duplicates);
only a batch that fails the screen pays for per-item validation. In steady decode most
appends land inside the sequence's exclusive partial last block: that is a few integer
operations per sequence (no block, no copy, same table), and hashing happens only when a
block fills up. Growing a table (a new block, copy-on-write of a shared partial block) takes
the general path, `_grow`.

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
from dataclasses import dataclass, field

from block_manager.core.errors import CoreError, InvalidRequest, OutOfBlocks, PendingWrite, UnknownSequence
from block_manager.core.hashing import hash_block_bytes, salt_bytes

from .pool import Pool
from .sequence import Sequence
from .steps import touch
from .types import CopyOp, PoolId, SeqId

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


@dataclass(slots=True)
class AppendOutcome:
    """What a batched append did: per item, the sequence's token count after it (0 for a
    failed item), the failed items (index, error; that sequence is unchanged), and the
    copy-on-write op of each item that needed one."""

    num_tokens: list[int]
    failures: list[tuple[int, CoreError]] = field(default_factory=list)
    copy_ops: dict[int, CopyOp] = field(default_factory=dict)


def _screen(
    seqs: dict[SeqId, Sequence],
    pools: dict[PoolId, Pool],
    seq_ids: Seq[str],
    counts: Seq[int],
    token_ids: Seq[int] | None,
    already_written: bool,
) -> tuple[array | None, dict[int, CoreError]]:
    """The token ids as an int64 array and the items that are invalid on their own.

    One pass of C-level checks decides whether the batch is clean (the common case); only
    a batch that is not gets the precise per-item validation."""
    if len(counts) != len(seq_ids):
        raise InvalidRequest(f"{len(counts)} token counts for {len(seq_ids)} sequences")
    toks: array | None = None
    clean = not already_written and len(set(seq_ids)) == len(seq_ids) and set(map(type, counts)) <= {int}
    clean = clean and (not counts or min(counts) > 0)
    if token_ids is not None:
        if isinstance(token_ids, array) and token_ids.typecode == "q":
            toks = token_ids
        else:
            try:
                if set(map(type, token_ids)) <= {int}:
                    toks = array("q", token_ids)
            except OverflowError:
                pass
        if toks is None or (clean and len(toks) != sum(counts)):
            clean = False
    if clean and all(map(seqs.__contains__, seq_ids)):
        return toks, {}
    return _validate_items(seqs, pools, seq_ids, counts, token_ids, already_written)


def _validate_items(
    seqs: dict[SeqId, Sequence],
    pools: dict[PoolId, Pool],
    seq_ids: Seq[str],
    counts: Seq[int],
    token_ids: Seq[int] | None,
    already_written: bool,
) -> tuple[array | None, dict[int, CoreError]]:
    """The precise path: each item checked alone; token ids normalised to int64."""
    bad: dict[int, CoreError] = {}
    seen: set[str] = set()
    flat: list[int] = []
    pos = 0
    for i, (sid, n) in enumerate(zip(seq_ids, counts)):
        ok_count = type(n) is int and n > 0
        k = n if ok_count else 0
        item_toks = None if token_ids is None else token_ids[pos : pos + k]
        pos += k
        err = item_error(seqs, pools, seen, sid, n, item_toks, already_written)
        if err is not None:
            bad[i] = err
            if item_toks is not None:
                flat.extend([0] * len(item_toks))  # keeps the flat offsets of the items after it
        elif item_toks is not None:
            flat.extend(operator.index(t) for t in item_toks)
        if sid in seqs:
            seen.add(sid)
    if token_ids is not None and pos != len(token_ids):
        raise InvalidRequest(f"{len(token_ids)} token ids for {pos} new tokens (give all or none)")
    return (array("q", flat) if token_ids is not None else None), bad


def item_error(
    seqs: dict[SeqId, Sequence],
    pools: dict[PoolId, Pool],
    seen: set[str],
    sid: str,
    n: object,
    toks: Seq[int] | None,
    already_written: bool,
) -> CoreError | None:
    seq = seqs.get(SeqId(sid))
    if seq is None:
        return UnknownSequence(f"unknown sequence {sid!r}")
    if sid in seen:
        return InvalidRequest(f"sequence {sid!r} appears twice in one batch")
    if type(n) is not int or n <= 0:
        return InvalidRequest(f"num_new_tokens must be a positive int, got {n!r}")
    if toks is not None:
        if len(toks) != n:
            return InvalidRequest(f"{len(toks)} token ids for {n} new tokens")
        for t in toks:
            try:
                value = operator.index(t)
            except TypeError:
                value = None
            if value is None or isinstance(t, bool) or not _INT64_MIN <= value <= _INT64_MAX:
                return InvalidRequest(f"token id {t!r} is not an int64 integer")
    if already_written:
        pool = pools[seq.pool_id]
        bs = pool.block_size
        off = seq.num_tokens % bs
        if off == 0 or off + n >= bs or pool.ref_cnt[seq.block_table[-1]] > 1:
            return InvalidRequest(
                f"sequence {sid!r}: {n} already-written tokens must lie inside its exclusive, partial "
                f"last block ({off} of {bs} slots used)"
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


def _grow(pool: Pool, seq: Sequence, n: int) -> CopyOp | None:
    """The general append: new blocks at block boundaries, copy-on-write of a shared partial
    last block (only once the step that wrote it is settled). Raises with nothing changed."""
    bs = pool.block_size
    table = seq.block_table
    old = seq.num_tokens
    new = old + n
    off = old % bs
    num_new_blocks = (new + bs - 1) // bs - len(table)
    cow = off != 0 and pool.ref_cnt[table[-1]] > 1
    if num_new_blocks + cow > pool.num_available:
        raise OutOfBlocks(
            f"pool {seq.pool_id!r}: sequence {seq.seq_id!r} needs {num_new_blocks + cow} blocks, "
            f"{pool.num_available} available"
        )
    write_step = pool.write_step
    if cow and write_step[table[-1]] > pool.settled_step:
        raise _pending(seq, table[-1], pool)
    step = pool.step
    step_id = step.step_id
    dirty = touch(step, seq)
    op = None
    if cow:
        src = table[-1]
        dst = pool.take_block()
        table[-1] = dst
        pool.release_block(src)
        op = pool.add_copy_op(src, dst, "cow")
        pool.cow_copies += 1
        if len(table) - 1 < dirty.base_len and not dirty.created:
            dirty.replaced.add(len(table) - 1)
    take = pool.take_block
    for _ in range(num_new_blocks):
        table.append(take())
    seq.version = pool.new_version()
    seq.num_tokens = new
    seq.last_step = seq.last_write_step = step_id
    step.has_writes = True   # (the batch sets it too; _grow also serves single appends)
    for i in range(old // bs, len(table)):
        write_step[table[i]] = step_id
    return op


def append_columns(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[str],
    counts: Seq[int],
    token_ids: Seq[int] | None = None,
    *,
    already_written: bool = False,
) -> AppendOutcome:
    """Append `counts[i]` tokens to `seq_ids[i]`; `token_ids` (flat, all or none) let full
    blocks be hashed. See `BlockManager.append_tokens`."""
    toks, bad = _screen(seqs, pools, seq_ids, counts, token_ids, already_written)
    if not bad:
        return _append_valid(pools, seqs, seq_ids, counts, toks, already_written)
    # Some items are invalid on their own: run the valid ones, then put the answers back in
    # request order (an invalid item's token ids are skipped in the flat list).
    keep = [i for i in range(len(seq_ids)) if i not in bad]
    starts = [0]
    for i in range(len(seq_ids)):
        n = counts[i]
        starts.append(starts[-1] + (n if type(n) is int and n > 0 else 0))
    sub_toks = None
    if toks is not None:
        sub_toks = array("q")
        for i in keep:
            sub_toks.extend(toks[starts[i] : starts[i + 1]])
    sub = _append_valid(pools, seqs, [seq_ids[i] for i in keep], [counts[i] for i in keep], sub_toks,
                        already_written)
    out = AppendOutcome([0] * len(seq_ids))
    for j, i in enumerate(keep):
        out.num_tokens[i] = sub.num_tokens[j]
    out.failures = sorted([*bad.items(), *((keep[j], e) for j, e in sub.failures)], key=lambda f: f[0])
    out.copy_ops = {keep[j]: op for j, op in sub.copy_ops.items()}
    return out


def _append_valid(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[str],
    counts: Seq[int],
    toks: array | None,
    already_written: bool,
) -> AppendOutcome:
    """The loop over screened items (every sequence exists, counts are positive ints, `toks`
    has exactly their ids). Kept flat, locals only where it can: this loop is the per-token
    cost of the whole service."""
    out = AppendOutcome([])
    push = out.num_tokens.append
    get = seqs.get
    touched: list[Pool] = []
    last_pid = None
    mark = not already_written
    pos = 0
    i = -1
    for sid, n in zip(seq_ids, counts):
        i += 1
        seq: Sequence = get(sid)  # type: ignore[assignment]
        pid = seq.pool_id
        if pid is not last_pid:
            last_pid = pid
            pool = pools[pid]
            touched.append(pool)
            bs = pool.block_size
            ref = pool.ref_cnt
            write_step = pool.write_step
            step_id = pool.step.step_id
        nt = seq.num_tokens
        off = nt % bs
        last = seq.block_table[-1] if off else -1
        if off and off + n <= bs and ref[last] == 1:
            # Inside (or exactly filling) an exclusive partial block: same table, no copy.
            nt += n
            seq.num_tokens = nt
            if mark:
                write_step[last] = step_id
                seq.last_write_step = step_id
            filled = off + n == bs
        else:
            try:
                op = _grow(pool, seq, n)
            except CoreError as exc:
                out.failures.append((i, exc))
                push(0)
                pos += n
                continue
            if op is not None:
                out.copy_ops[i] = op
            nt += n
            filled = True   # maybe: the hashing below checks
        if seq.hashing:
            if toks is None:
                # Content unknown from here on: the chain cannot continue.
                seq.hashing = False
                seq.tail_token_ids = []
                seq.block_hashes = []
            else:
                tail = seq.tail_token_ids
                if n == 1:
                    tail.append(toks[pos])
                else:
                    tail.extend(toks[pos : pos + n])
                if filled and len(tail) >= bs:
                    _hash_full_blocks(pool, seq)
        pos += n
        push(nt)
    # One step per pool that got tokens (a pool whose every item failed is unchanged).
    if out.failures:
        ok = {seqs[SeqId(sid)].pool_id for sid, nt in zip(seq_ids, out.num_tokens) if nt}
        touched = [p for p in touched if p.pool_id in ok]
    for p in set(touched):
        p.num_steps += 1
        if mark:
            p.step.has_writes = True
    return out


__all__ = ["AppendOutcome", "append_columns", "item_error"]
