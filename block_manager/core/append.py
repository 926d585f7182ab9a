"""The batched append: one call per scheduler step for every running sequence
(`BlockManager.append_tokens`, and `append_slots` over it: append_slots.py).

Per sequence: blocks added at block boundaries, and a copy-on-write op when the partial last
block is shared (ref_cnt > 1: the sequence gets a fresh block, the node copies the old one
first — only once the step that wrote that block is settled, `PendingWrite` otherwise). A
sequence that fails (unknown, malformed, out of blocks) is listed in `failures` and is
unchanged; the others proceed in request order. The new tokens' slots follow from the tables
(`slot_range`), which reach the node as the step's deltas. A batch without token ids stops
hashing for its sequences: the chain cannot continue without content. `num_late` is for a
scheduler that plans a step before the previous one sampled (append_item.py).

This is the hot path, so it is columnar: parallel lists of sequence ids and token counts and
one flat list of token ids (what the Step RPC carries), answered with one list of token
counts. The batch is screened as a whole with C-level operations (types, ranges, duplicates);
only a batch that fails the screen pays for per-item validation. In steady decode most
appends land inside the sequence's exclusive partial last block (no block, no copy, same
table), and hashing happens only when a block fills up. A batch of `VECTOR_MIN_ITEMS` or more
runs those appends, and plain block crossings, as array operations over the pool's sequence
columns (append_batch.py); smaller batches, and the items the arrays do not cover (growing a
table by copy-on-write or several blocks, hashing a filled block), run item by item
(append_item.py).

Every append is recorded in its pool's open step (steps.py): the blocks that receive slots
get `write_step` = the open step, tables that gain or replace a block are noted for the step's
deltas. `already_written=True` reports tokens a scheduler wrote before telling the block
manager (in-block decode appends it answered locally): they get slots like any append, but
they were written by Forwards that are already complete, so nothing of the step changes and
no block may be added or filled by them. `num_late` (appends only) says, per item, how many
of its last tokens' ids come with a later Step (late ids: append_item.py).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence as Seq

import numpy as np

from block_manager.core.append_batch import append_pool, decode_arrays
from block_manager.core.append_item import AppendOutcome, append_items, count_steps, resolve_late
from block_manager.core.errors import CoreError, InvalidRequest, UnknownSequence
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence, late_pending
from block_manager.core.types import PoolId, SeqId

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def _screen(
    seqs: dict[SeqId, Sequence],
    pools: dict[PoolId, Pool],
    seq_ids: Seq[SeqId],
    counts: Seq[int],
    token_ids: Seq[int] | None,
    already_written: bool,
) -> tuple[array | None, dict[int, CoreError], np.ndarray | None]:
    """The token ids as an int64 array, the items that are invalid on their own, and (for a
    clean batch of `VECTOR_MIN_ITEMS` or more on one pool) the items' rows in its columns.

    One pass of C-level checks decides whether the batch is clean (the common case); only
    a batch that is not gets the precise per-item validation. A decode batch (every count 1)
    skips the passes its counts make moot, and a large batch of one pool proves its ids known
    and distinct through the row lookup it needs anyway (issue 45: the screen was half the
    cost of an in-block step)."""
    n = len(seq_ids)
    if len(counts) != n:
        raise InvalidRequest(f"{len(counts)} token counts for {n} sequences")
    toks: array | None = None
    ones = isinstance(counts, (list, tuple)) and counts.count(1) == n
    # (`count(1)` also counts True: the type pass still runs)
    clean = not already_written and set(map(type, counts)) <= {int}
    clean = clean and (ones or not counts or min(counts) > 0)
    if token_ids is not None:
        if isinstance(token_ids, array) and token_ids.typecode == "q":
            toks = token_ids
        else:
            try:
                if set(map(type, token_ids)) <= {int}:
                    toks = array("q", token_ids)
            except OverflowError:
                pass
        if toks is None or (clean and len(toks) != (n if ones else sum(counts))):
            clean = False
    if clean:
        rows = _known_rows(seqs, pools, seq_ids) if n >= VECTOR_MIN_ITEMS else None
        if rows is not None:
            return toks, {}, rows
        if len(set(seq_ids)) == n and all(map(seqs.__contains__, seq_ids)):
            return toks, {}, None
    toks, bad = _validate_items(seqs, pools, seq_ids, counts, token_ids, already_written)
    return toks, bad, None


def _known_rows(seqs: dict[SeqId, Sequence], pools: dict[PoolId, Pool], seq_ids: Seq[SeqId]) -> np.ndarray | None:
    """The rows of `seq_ids` in their pool's columns when every id is a distinct sequence of
    the first one's pool (a row exists only for a live sequence of that pool); None otherwise
    (unknown ids, duplicates, several pools: the caller checks the slow way)."""
    first = seqs.get(seq_ids[0])
    if first is None:
        return None
    cols = pools[first.pool_id].cols
    try:
        rows = np.fromiter(map(cols.row_of.__getitem__, seq_ids), np.intp, len(seq_ids))
    except KeyError:
        return None
    seen = np.zeros(cols.capacity, np.bool_)
    seen[rows] = True
    return rows if int(np.count_nonzero(seen)) == len(seq_ids) else None


def _validate_items(
    seqs: dict[SeqId, Sequence],
    pools: dict[PoolId, Pool],
    seq_ids: Seq[SeqId],
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
            if value is None or isinstance(t, bool) or not INT64_MIN <= value <= INT64_MAX:
                return InvalidRequest(f"token id {t!r} is not an int64 integer")
    if already_written:
        pool = pools[seq.pool_id]
        if (pending := late_pending(seq)) is not None:
            return pending
        bs = pool.block_size
        off = seq.num_tokens % bs
        if off == 0 or off + n >= bs or pool.ref_cnt[seq.block_table[-1]] > 1:
            return InvalidRequest(
                f"sequence {sid!r}: {n} already-written tokens must lie inside its exclusive, partial "
                f"last block ({off} of {bs} slots used)"
            )
    return None


def append_columns(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[SeqId],
    counts: Seq[int],
    token_ids: Seq[int] | None = None,
    *,
    already_written: bool = False,
    num_late: Seq[int] | None = None,
) -> AppendOutcome:
    """Append `counts[i]` tokens to `seq_ids[i]`; `token_ids` (flat, all or none) let full
    blocks be hashed; the last `num_late[i]` of item i's ids come later. See
    `BlockManager.append_tokens`."""
    late = _late_counts(num_late, len(seq_ids), token_ids is not None, already_written)
    toks, bad, rows = _screen(seqs, pools, seq_ids, counts, token_ids, already_written)
    if not bad:
        return _append_valid(pools, seqs, seq_ids, counts, toks, already_written, late, rows)
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
                        already_written, None if late is None else [late[i] for i in keep])
    out = AppendOutcome([0] * len(seq_ids))
    for j, i in enumerate(keep):
        out.num_tokens[i] = sub.num_tokens[j]
    out.failures = sorted([*bad.items(), *((keep[j], e) for j, e in sub.failures)], key=lambda f: f[0])
    out.copy_ops = {keep[j]: op for j, op in sub.copy_ops.items()}
    return out


def _late_counts(num_late: Seq[int] | None, n: int, with_ids: bool, already_written: bool) -> list[int] | None:
    """The per-item late-id counts as a list, None when there are none (or no ids at all:
    a batch without ids hashes nothing, so it has no ids to send later)."""
    if num_late is None or not len(num_late):
        return None
    late = list(num_late)
    if len(late) != n:
        raise InvalidRequest(f"{len(late)} late-id counts for {n} appends")
    if not set(map(type, late)) <= {int} or min(late) < 0:
        raise InvalidRequest("late-id counts must be integers >= 0")
    if not any(late) or not with_ids:
        return None
    if already_written:
        raise InvalidRequest("already-written tokens have known ids: they cannot have late ids")
    return late


# Below this many items a batch runs item by item: numpy's fixed cost per call (about a µs
# for each of the ~40 array operations of a batch) is more than the per-item Python it
# replaces (measured: bench/bench_core.py --sizes).
VECTOR_MIN_ITEMS = 64
def _append_valid(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[SeqId],
    counts: Seq[int],
    toks: array | None,
    already_written: bool,
    late: list[int] | None = None,
    known_rows: np.ndarray | None = None,
) -> AppendOutcome:
    """The screened items (every sequence exists once, counts are positive ints, `toks` has
    exactly their ids), in request order as far as anyone can observe: per pool, the in-block
    appends and the plain block crossings of the batch run as array operations over the pool's
    sequence columns, the rest (copy-on-write, several blocks at once, blocks that fill and
    get hashed) item by item in request order. Items of different pools share no state, so
    pools run one after another. `known_rows`: the items' rows when the screen found them all
    in one pool."""
    n = len(seq_ids)
    mark = not already_written
    if n < VECTOR_MIN_ITEMS:
        return append_items(pools, seqs, seq_ids, counts, toks, mark, late)
    out = AppendOutcome([0] * n)
    ok_pools: set[PoolId] = set()
    ones = counts.count(1) == n if isinstance(counts, (list, tuple)) else False
    if ones:
        cnt, starts = decode_arrays(n)
    else:
        cnt = np.fromiter(counts, np.int64, n)
        starts = np.cumsum(cnt) - cnt
    lt = None if late is None else np.array(late, np.int64)
    tk = None if toks is None else np.frombuffer(toks, dtype=np.int64) if len(toks) else np.zeros(0, np.int64)
    pool = pools[seqs[seq_ids[0]].pool_id]
    try:
        rows = known_rows if known_rows is not None else np.fromiter(map(pool.cols.row_of.__getitem__, seq_ids),
                                                                     np.intp, n)
    except KeyError:   # several pools in one batch
        col = [seqs[sid].pool_id for sid in seq_ids]
        groups: list[tuple[PoolId, np.ndarray | None]] = [
            (pid, np.array([i for i, p in enumerate(col) if p == pid], np.intp)) for pid in dict.fromkeys(col)]
    else:
        groups = [(pool.pool_id, None)]
    for pid, sel in groups:
        pool = pools[pid]
        if sel is not None:
            rows = np.fromiter(map(pool.cols.row_of.__getitem__, [seq_ids[i] for i in sel.tolist()]),
                               np.intp, len(sel))
        if append_pool(pool, seqs, seq_ids, sel, rows, cnt, starts, toks, tk, mark, ones, out, lt):
            ok_pools.add(pid)
    if len(groups) > 1:
        out.failures.sort(key=lambda f: f[0])
    # One step per pool that got tokens (a pool whose every item failed is unchanged).
    count_steps([pools[pid] for pid in ok_pools], mark)
    return out


def can_append(pool: Pool, seq: Sequence, num_new_tokens: int) -> bool:
    """`BlockManager.can_append`, the count checked."""
    bs = pool.block_size
    needed = -(-(seq.num_tokens + num_new_tokens) // bs) - len(seq.block_table)
    if seq.num_tokens % bs and pool.ref_cnt[seq.block_table[-1]] > 1:
        if not pool.written(seq.block_table[-1]):
            return False  # the copy-on-write source is not written yet (PendingWrite)
        needed += 1
    return needed <= pool.num_available


def resolve_late_columns(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_ids: Seq[SeqId],
                         num_token_ids: Seq[int], token_ids: Seq[int]) -> list[tuple[int, CoreError]]:
    """`BlockManager.resolve_late`: per item, the ids or why not (that item unchanged)."""
    if len(num_token_ids) != len(seq_ids):
        raise InvalidRequest(f"{len(num_token_ids)} late-id counts for {len(seq_ids)} sequences")
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidRequest("a sequence appears twice among the late ids")
    if sum(num_token_ids) != len(token_ids):
        raise InvalidRequest(f"{len(token_ids)} late ids for counts summing to {sum(num_token_ids)}")
    failures: list[tuple[int, CoreError]] = []
    pos = 0
    for i, (sid, k) in enumerate(zip(seq_ids, num_token_ids)):
        ids = token_ids[pos : pos + k]
        pos += k
        seq = seqs.get(sid)
        if seq is None:
            failures.append((i, UnknownSequence(f"unknown sequence {sid!r}")))
            continue
        bad = next((t for t in ids if type(t) is not int or not INT64_MIN <= t <= INT64_MAX), None)
        try:
            if bad is not None:
                raise InvalidRequest(f"token id {bad!r} is not an int64 integer")
            resolve_late(pools[seq.pool_id], seq, ids)
        except CoreError as exc:
            failures.append((i, exc))
    return failures


__all__ = ["INT64_MAX", "INT64_MIN", "VECTOR_MIN_ITEMS", "AppendOutcome", "append_columns", "can_append", "item_error",
           "resolve_late_columns"]
