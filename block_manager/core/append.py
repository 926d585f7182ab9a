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
import sys
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from block_manager.core.errors import CoreError, InvalidRequest, OutOfBlocks, PendingWrite, UnknownSequence
from block_manager.core.hashing import hash_block_bytes, hash_encoded, salt_bytes
from block_manager.core.pool import BlockMeta, Pool
from block_manager.core.sequence import Sequence
from block_manager.core.steps import touch
from block_manager.core.types import CopyOp, PoolId, SeqId

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


def _hash_tail(pool: Pool, seq: Sequence, tail: list[int]) -> list[int]:
    """Hash and register every full block at the front of `tail` (each chained on the
    previous one); returns the tokens left over (the new partial block)."""
    bs = pool.block_size
    salt_enc = salt_bytes(seq.salt)
    hashes = seq.block_hashes
    table = seq.block_table
    start = 0
    while len(tail) - start >= bs:
        block_tokens = tuple(tail[start : start + bs])
        start += bs
        parent = hashes[-1] if hashes else None
        h = hash_block_bytes(parent, array("q", block_tokens), salt_enc)
        b = table[len(hashes)]
        if pool.register(b, h, parent, seq.salt, block_tokens):
            pool.step.registrations.append((b, h))
        hashes.append(h)
    return tail[start:]


def _stop_hashing(seq: Sequence) -> None:
    """Content unknown from here on: the chain cannot continue."""
    cols = seq.cols
    cols.hashing[seq.row] = 0
    cols.tail_len[seq.row] = 0
    seq.block_hashes = []


def _grow(pool: Pool, seq: Sequence, n: int) -> CopyOp | None:
    """The general append: new blocks at block boundaries, copy-on-write of a shared partial
    last block (only once the step that wrote it is settled). Raises with nothing changed."""
    bs = pool.block_size
    table = seq.block_table
    cols = pool.cols
    row = seq.row
    old = cols.num_tokens[row]
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
    cols.last_block[row] = table[-1]
    seq.version = pool.new_version()
    cols.num_tokens[row] = new
    cols.last_write_step[row] = seq.last_step = step_id
    step.has_writes = True   # (the batch sets it too; _grow also serves single appends)
    for i in range(old // bs, len(table)):
        write_step[table[i]] = step_id
    return op


def _append_one(pool: Pool, seq: Sequence, n: int, toks: Seq[int] | None, mark: bool) -> tuple[int, CopyOp | None]:
    """One item of a batch, alone: the sequence's token count after it and its copy-on-write
    op. Raises a `CoreError` with nothing changed. Reads and writes the columns' stdlib
    arrays (per-item indexing of those is as cheap as a list's)."""
    cols = pool.cols
    row = seq.row
    bs = pool.block_size
    nt = cols.num_tokens[row]
    off = nt % bs
    op = None
    if off and off + n <= bs and pool.ref_cnt[last := cols.last_block[row]] == 1:
        # Inside (or exactly filling) an exclusive partial block: same table, no copy.
        nt += n
        cols.num_tokens[row] = nt
        if mark:
            step_id = pool.step.step_id
            pool.write_step[last] = step_id
            cols.last_write_step[row] = step_id
    else:
        op = _grow(pool, seq, n)
        nt += n
    if cols.hashing[row]:
        if toks is None:
            _stop_hashing(seq)
        else:
            k = cols.tail_len[row]
            base = row * bs
            if k + n < bs:
                if n == 1:
                    cols.tail[base + k] = toks[0]
                else:
                    cols.tail[base + k : base + k + n] = array("q", toks)
                cols.tail_len[row] = k + n
            else:
                rest = _hash_tail(pool, seq, [*cols.tail[base : base + k], *toks])
                seq.tail_token_ids = rest
    return nt, op


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


# Below this many items a batch runs item by item: numpy's fixed cost per call (about a µs
# for each of the ~40 array operations of a batch) is more than the per-item Python it
# replaces (measured: bench/bench_core.py --sizes).
VECTOR_MIN_ITEMS = 64
_LITTLE_ENDIAN = sys.byteorder == "little"
_NO_SALT = salt_bytes(None)


_ONES: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _ones(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts and token offsets of a decode batch of `n` (read-only, cached per size)."""
    got = _ONES.get(n)
    if got is None:
        if len(_ONES) >= 64:
            _ONES.clear()
        ones, starts = np.ones(n, np.int64), np.arange(n, dtype=np.int64)
        ones.flags.writeable = starts.flags.writeable = False
        got = _ONES[n] = (ones, starts)
    return got


def _append_valid(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[str],
    counts: Seq[int],
    toks: array | None,
    already_written: bool,
) -> AppendOutcome:
    """The screened items (every sequence exists once, counts are positive ints, `toks` has
    exactly their ids), in request order as far as anyone can observe: per pool, the in-block
    appends and the plain block crossings of the batch run as array operations over the pool's
    sequence columns, the rest (copy-on-write, several blocks at once, blocks that fill and
    get hashed) item by item in request order. Items of different pools share no state, so
    pools run one after another."""
    n = len(seq_ids)
    mark = not already_written
    if n < VECTOR_MIN_ITEMS:
        return _append_items(pools, seqs, seq_ids, counts, toks, mark)
    out = AppendOutcome([0] * n)
    ok_pools: set[PoolId] = set()
    ones = counts.count(1) == n if isinstance(counts, (list, tuple)) else False
    if ones:
        cnt, starts = _ones(n)
    else:
        cnt = np.fromiter(counts, np.int64, n)
        starts = np.cumsum(cnt) - cnt
    tk = None if toks is None else np.frombuffer(toks, dtype=np.int64) if len(toks) else np.zeros(0, np.int64)
    pool = pools[seqs[seq_ids[0]].pool_id]  # type: ignore[index]
    try:
        rows = np.fromiter(map(pool.cols.row_of.__getitem__, seq_ids), np.intp, n)
    except KeyError:   # several pools in one batch
        col = [seqs[sid].pool_id for sid in seq_ids]  # type: ignore[index]
        groups = [(pid, np.array([i for i, p in enumerate(col) if p == pid], np.intp))
                  for pid in dict.fromkeys(col)]
    else:
        groups = [(pool.pool_id, None)]
    for pid, sel in groups:
        pool = pools[pid]
        if sel is not None:
            rows = np.fromiter(map(pool.cols.row_of.__getitem__, [seq_ids[i] for i in sel.tolist()]),
                               np.intp, len(sel))
        if _append_pool(pool, seqs, seq_ids, sel, rows, cnt, starts, toks, tk, mark, ones, out):
            ok_pools.add(pid)
    if len(groups) > 1:
        out.failures.sort(key=lambda f: f[0])
    # One step per pool that got tokens (a pool whose every item failed is unchanged).
    for pid in ok_pools:
        p = pools[pid]
        p.num_steps += 1
        if mark:
            p.step.has_writes = True
    return out


def _append_items(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[str],
    counts: Seq[int],
    toks: array | None,
    mark: bool,
) -> AppendOutcome:
    """A small batch, item by item (the loop is kept flat: it is the per-token cost of a
    Step that carries only the sequences crossing a block)."""
    out = AppendOutcome([])
    push = out.num_tokens.append
    get = seqs.__getitem__
    touched: list[Pool] = []
    last_pid = None
    pos = 0
    i = -1
    for sid, n in zip(seq_ids, counts):
        i += 1
        seq: Sequence = get(sid)
        pid = seq.pool_id
        if pid is not last_pid:
            last_pid = pid
            pool = pools[pid]
            touched.append(pool)
            bs = pool.block_size
            ref = pool.ref_cnt
            write_step = pool.write_step
            step_id = pool.step.step_id
            cols = pool.cols
            ntc, lbc, lwc, hc, tail = cols.num_tokens, cols.last_block, cols.last_write_step, cols.hashing, cols.tail
        row = seq.row
        nt = ntc[row]
        off = nt % bs
        if off and off + n <= bs and ref[last := lbc[row]] == 1:
            # Inside (or exactly filling) an exclusive partial block: same table, no copy.
            nt += n
            ntc[row] = nt
            if mark:
                write_step[last] = step_id
                lwc[row] = step_id
            if hc[row]:
                if toks is None:
                    _stop_hashing(seq)
                else:   # the tail holds `off` tokens (the partial block's)
                    at = row * bs + off
                    if n == 1:
                        tail[at] = toks[pos]
                    else:
                        tail[at : at + n] = toks[pos : pos + n]
                    if off + n == bs:
                        _hash_full_row(pool, seq)
                    else:
                        cols.tail_len[row] = off + n
        else:
            try:
                nt, op = _append_one(pool, seq, n, None if toks is None else toks[pos : pos + n], mark)
            except CoreError as exc:
                out.failures.append((i, exc))
                push(0)
                pos += n
                continue
            if op is not None:
                out.copy_ops[i] = op
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


def _append_pool(
    pool: Pool,
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[str],
    sel: np.ndarray | None,
    rows: np.ndarray,
    cnt: np.ndarray,
    starts: np.ndarray,
    toks: array | None,
    tk: np.ndarray | None,
    mark: bool,
    ones: bool,
    out: AppendOutcome,
) -> bool:
    """The items `sel` (all when None; their rows `rows`) of one pool, answered into `out`;
    whether any of them succeeded.

    Two kinds of item run as array operations: in-block appends (inside or exactly filling
    an exclusive partial last block) and plain crossings (the table is full and the tokens
    fit one new block: no copy). Crossings take their blocks in request order, so they run
    as arrays only when no other item of the batch takes blocks and the pool has a block
    for each; otherwise they go item by item with the rest."""
    cols = pool.cols
    bs = pool.block_size
    num = len(rows)
    c, st = (cnt, starts) if sel is None else (cnt[sel], starts[sel])
    nt0 = cols.num_tokens_np[rows]
    off = nt0 % bs
    last = cols.last_block_np[rows]
    if ones:
        end = off + 1
        fast = (off != 0) & (pool.ref_np[last] == 1)
    else:
        end = off + c
        fast = (off != 0) & (end <= bs) & (pool.ref_np[last] == 1)
    nt1 = nt0 + c
    step_id = pool.step.step_id
    num_fast = int(np.count_nonzero(fast))
    simple = fast
    cross: list[int] = []
    if num_fast < num:
        crossing = (off == 0) if ones else (off == 0) & (c <= bs)
        num_cross = int(np.count_nonzero(crossing))
        if num_cross and num_fast + num_cross == num and num_cross <= pool.num_available:
            simple = fast | crossing
            cross = crossing.nonzero()[0].tolist()
    if num_fast == num or cross:
        # Every item is in-block or a plain crossing: one scatter each for all of them (a
        # crossing's new count and writing step are the same; only its block differs).
        cols.num_tokens_np[rows] = nt1
        if mark:
            pool.write_step_np[last if num_fast == num else last[fast]] = step_id
            cols.last_write_step_np[rows] = step_id
        if cross:
            _cross(pool, seqs, seq_ids, sel, rows, cross, step_id)
    elif num_fast:
        rs = rows[fast]
        cols.num_tokens_np[rs] = nt1[fast]
        if mark:
            pool.write_step_np[last[fast]] = step_id
            cols.last_write_step_np[rs] = step_id
    hf = simple & (cols.hashing_np[rows] != 0)
    per_item = ~simple
    filled: np.ndarray | None = None
    if tk is None:
        per_item |= hf
    elif hf.any():
        rh, oh, sh = rows[hf], off[hf], st[hf]
        if ones:
            cols.tail_np.reshape(-1)[rh * bs + oh] = tk[sh]
            cols.tail_len_np[rh] = oh + 1
        else:
            ch = c[hf]
            item = np.repeat(np.arange(len(ch)), ch)
            within = np.arange(int(ch.sum())) - np.repeat(np.cumsum(ch) - ch, ch)
            cols.tail_np[rh[item], oh[item] + within] = tk[sh[item] + within]
            cols.tail_len_np[rh] = oh + ch
        filled = hf & (end == bs)
    num_tokens = nt1.tolist()
    any_ok = num_fast > 0 or bool(cross)
    todo = per_item.nonzero()[0].tolist()
    req = sel.tolist() if sel is not None else None
    if filled is not None and not todo:
        # Only blocks that filled inside their tails: hash them straight from the columns.
        f = filled.nonzero()[0]
        if len(f):
            _hash_filled(pool, seqs, seq_ids, f.tolist() if req is None else [req[j] for j in f.tolist()], rows[f])
    elif todo or filled is not None:
        if filled is not None:
            todo = (per_item | filled).nonzero()[0].tolist()
        cl, sl, fl = c.tolist(), st.tolist(), simple.tolist()
        for j in todo:
            i = j if req is None else req[j]
            seq = seqs[seq_ids[i]]  # type: ignore[index]
            if fl[j]:
                if tk is None:
                    _stop_hashing(seq)
                else:   # its block filled: hash it
                    _hash_full_row(pool, seq)
                continue
            k, p = cl[j], sl[j]
            try:
                _, op = _append_one(pool, seq, k, None if toks is None else toks[p : p + k], mark)
            except CoreError as exc:
                out.failures.append((i, exc))
                num_tokens[j] = 0
                continue
            any_ok = True
            if op is not None:
                out.copy_ops[i] = op
    if req is None:
        out.num_tokens = num_tokens
    else:
        for j, i in enumerate(req):
            out.num_tokens[i] = num_tokens[j]
    return any_ok


def _cross(
    pool: Pool,
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[str],
    sel: np.ndarray | None,
    rows: np.ndarray,
    cross: list[int],
    step_id: int,
) -> None:
    """Plain crossings (positions `cross` of the pool's items, in request order): one new
    block each, at the end of the table; the caller checked that the pool has enough and
    wrote their counts and writing step."""
    step = pool.step
    dirty = step.dirty
    take = pool.take_block
    version = pool.last_version
    req = sel.tolist() if sel is not None else None
    new_blocks = []
    for j in cross:
        seq = seqs[seq_ids[j if req is None else req[j]]]  # type: ignore[index]
        if seq.seq_id not in dirty:
            touch(step, seq)
        b = take()
        seq.block_table.append(b)
        new_blocks.append(b)
        version += 1
        seq.version = version
        seq.last_step = step_id
    pool.last_version = version
    step.has_writes = True
    blocks = np.array(new_blocks, np.int64)
    pool.cols.last_block_np[rows[cross]] = blocks
    pool.write_step_np[blocks] = step_id


def _hash_filled(pool: Pool, seqs: dict[SeqId, Sequence], seq_ids: Seq[str], items: list[int],
                 rows: np.ndarray) -> None:
    """Hash and register the blocks the items' tails just filled, in request order (no other
    item of the batch touches the prefix index)."""
    if not _LITTLE_ENDIAN:
        for i in items:
            _hash_full_row(pool, seqs[seq_ids[i]])  # type: ignore[index]
        return
    cols = pool.cols
    blocks = cols.tail_np[rows]
    data = blocks.tobytes()
    token_lists = blocks.tolist()
    cols.tail_len_np[rows] = 0
    bs = pool.block_size
    width = 8 * bs
    size = bs.to_bytes(4, "little")
    regs = pool.step.registrations
    index = pool.prefix_index
    meta = pool.meta
    for j, i in enumerate(items):
        seq = seqs[seq_ids[i]]  # type: ignore[index]
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else None
        salt = seq.salt
        h = hash_encoded(parent, _NO_SALT if salt is None else salt_bytes(salt), size,
                         data[j * width : (j + 1) * width])
        b = seq.block_table[len(hashes)]
        if h not in index and meta[b] is None:   # `Pool.register`, inlined: the first block keeps a hash
            index[h] = b
            meta[b] = BlockMeta(h, parent, salt, tuple(token_lists[j]))
            regs.append((b, h))
        hashes.append(h)


def _hash_full_row(pool: Pool, seq: Sequence) -> None:
    """The sequence's tail just filled its last block: hash and register that block."""
    cols = pool.cols
    base = seq.row * pool.block_size
    _hash_tail(pool, seq, cols.tail[base : base + pool.block_size].tolist())
    cols.tail_len[seq.row] = 0


__all__ = ["AppendOutcome", "append_columns", "item_error"]
