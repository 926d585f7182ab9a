"""`BlockManager.append_slots`: the batched append with one request object in and one result
object out per sequence — its new tokens' slots, the blocks it gained and its copy-on-write
op (what an embedding scheduler that drives its workers directly wants). It runs the columnar
append (append.py) and derives each result from the tables afterwards: a table covers exactly
its tokens, so what a sequence had before follows from its count after, with no copy of the
state up front.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import chain
from operator import attrgetter

import numpy as np

from block_manager.core.append import VECTOR_MIN_ITEMS, append_columns, item_error
from block_manager.core.errors import CoreError
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence
from block_manager.core.slots import slot_range
from block_manager.core.types import AppendFailure, AppendRequest, AppendResult, CopyOp, PoolId, SeqId

_SEQ_ID = attrgetter("seq_id")
_NUM_NEW = attrgetter("num_new_tokens")
_TOKEN_IDS = attrgetter("token_ids")
_VERSION = attrgetter("version")


def append_slots(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], requests: Seq[AppendRequest],
                 already_written: bool) -> list[AppendResult | AppendFailure]:
    """See `BlockManager.append_slots`."""
    reqs = list(requests)
    seq_ids = list(map(_SEQ_ID, reqs))
    counts = list(map(_NUM_NEW, reqs))
    token_ids: list[tuple[int, ...] | None] = list(map(_TOKEN_IDS, reqs))
    bad: dict[int, CoreError]
    # (map/chain over the Optional tuples: C-level on the hot path; `None not in` rules None out)
    if token_ids.count(None) == len(reqs) or (
        None not in token_ids and list(map(len, token_ids)) == counts  # type: ignore[arg-type]  # no None here
    ):
        # The common batch: one columnar append, whose screen finds every item error.
        ids = None if not reqs or token_ids[0] is None else list(
            chain.from_iterable(token_ids))  # type: ignore[arg-type]  # no None here
        out = append_columns(pools, seqs, seq_ids, counts, ids, already_written=already_written)
        bad = dict(out.failures)
        ops = out.copy_ops
        after = out.num_tokens
    else:
        bad, ops = _itemwise(pools, seqs, reqs, already_written)
        after = [0 if i in bad else seqs[sid].num_tokens for i, sid in enumerate(seq_ids)]
    if not bad and len(reqs) >= VECTOR_MIN_ITEMS and counts.count(1) == len(reqs):
        decoded = _decode_results(pools, seqs, seq_ids, after, ops)
        if decoded is not None:
            return decoded
    return _results(pools, seqs, seq_ids, counts, after, bad, ops)


def _results(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_ids: list[SeqId], counts: list[int],
             after: list[int], bad: dict[int, CoreError], ops: dict[int, CopyOp]) -> list[AppendResult | AppendFailure]:
    """Each item's result from its table after the append (`after`: its token count)."""
    results: list[AppendResult | AppendFailure] = []
    push = results.append
    last_pid = None
    bs = 1
    for i, (sid, n, nt) in enumerate(zip(seq_ids, counts, after)):
        if bad and i in bad:
            push(AppendFailure(sid, bad[i]))
            continue
        seq = seqs[sid]
        if seq.pool_id is not last_pid:
            last_pid = seq.pool_id
            bs = pools[last_pid].block_size
        table = seq.block_table
        op = ops.get(i) if ops else None
        old = nt - n
        if n == 1:   # decode: its slot is in the last block, which is new when `old` was aligned
            off = old % bs
            last = table[-1]
            push(AppendResult(sid, (last * bs + off,), () if off else (last,), () if op is None else (op,),  # type: ignore[arg-type]  # block ids are plain ints at run time (BlockId is a NewType)
                              seq.version, nt))
        else:
            push(AppendResult(
                sid, slot_range(table, bs, old, nt), tuple(table[-(-old // bs):]),  # type: ignore[arg-type]  # as above
                () if op is None else (op,), seq.version, nt,
            ))
    return results


def _decode_results(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], seq_ids: list[SeqId],
                    after: list[int], ops: dict[int, CopyOp]) -> list[AppendResult | AppendFailure] | None:
    """The results of a decode batch of one pool (one token each, none failed), from the
    columns: the token went to the (new) last block, which is a new block when the sequence
    was block-aligned before. None: several pools (the general loop runs)."""
    pool = pools[seqs[seq_ids[0]].pool_id]
    cols = pool.cols
    try:
        rows = np.fromiter(map(cols.row_of.__getitem__, seq_ids), np.intp, len(seq_ids))
    except KeyError:
        return None
    bs = pool.block_size
    last = cols.last_block_np[rows]
    off = (np.array(after, np.int64) - 1) % bs
    slots = list(zip((last * bs + off).tolist()))
    new: list[tuple[int, ...]] = [()] * len(seq_ids)
    crossed = (off == 0).nonzero()[0]
    for i, b in zip(crossed.tolist(), last[crossed].tolist()):
        new[i] = (b,)
    copies: list[tuple[CopyOp, ...]] = [()] * len(seq_ids)
    for i, op in ops.items():
        copies[i] = (op,)
    versions = list(map(_VERSION, map(seqs.__getitem__, seq_ids)))
    return list(map(AppendResult, seq_ids, slots, new, copies, versions, after))


def _itemwise(pools: dict[PoolId, Pool], seqs: dict[SeqId, Sequence], reqs: list[AppendRequest],
              already_written: bool) -> tuple[dict[int, CoreError], dict[int, CopyOp]]:
    """A batch whose items' token tuples disagree with their counts (a flat list cannot say
    which) or that mixes items with and without token ids: each item validated alone, then
    columnar runs (mixed: one item at a time). Several runs are still one scheduler step:
    each pool counts it once (the defrag policy's `every_n_steps` cadence reads the count)."""
    bad: dict[int, CoreError] = {}
    seen: set[str] = set()
    for i, r in enumerate(reqs):
        err = item_error(seqs, pools, seen, r.seq_id, r.num_new_tokens, r.token_ids, already_written)
        if err is not None:
            bad[i] = err
        if r.seq_id in seqs:
            seen.add(r.seq_id)
    good = [i for i in range(len(reqs)) if i not in bad]
    with_ids = [i for i in good if reqs[i].token_ids is not None]
    runs = [good] if len(with_ids) in (0, len(good)) else [[i] for i in good]
    ops: dict[int, CopyOp] = {}
    steps_before = {pid: pool.num_steps for pid, pool in pools.items()}
    for run in runs:
        rs = [reqs[i] for i in run]
        ids = None if rs and rs[0].token_ids is None else [t for r in rs for t in r.token_ids or ()]
        out = append_columns(pools, seqs, [r.seq_id for r in rs], [r.num_new_tokens for r in rs],
                             ids, already_written=already_written)
        for j, err in out.failures:
            bad[run[j]] = err
        for j, op in out.copy_ops.items():
            ops[run[j]] = op
    for pid, num_steps in steps_before.items():
        pool = pools[pid]
        pool.num_steps = min(pool.num_steps, num_steps + 1)
    return bad, ops


__all__ = ["append_slots"]
