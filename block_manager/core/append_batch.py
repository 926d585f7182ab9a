"""The batched append as array operations over one pool's sequence columns (numpy views):
in-block appends and plain block crossings for the whole batch at once, the blocks that fill
hashed in one pass; everything else goes item by item (append_item.py), in request order."""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence as Seq

import numpy as np

from block_manager.core.append_item import AppendOutcome, append_one, hash_full_row, stop_hashing
from block_manager.core.errors import CoreError
from block_manager.core.hashing import hash_encoded, salt_bytes
from block_manager.core.pool import BlockMeta, FreeRun, Pool
from block_manager.core.sequence import Sequence
from block_manager.core.step_work import touch
from block_manager.core.types import SeqId

_LITTLE_ENDIAN = sys.byteorder == "little"
_NO_SALT = salt_bytes(None)
# A `BlockMeta` straight from its field tuple: the named tuple's own constructor is a Python
# function (a frame per filled block); this is the C call it makes.
_new_meta = tuple.__new__



_ONES: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def decode_arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts and token offsets of a decode batch of `n` (read-only, cached per size)."""
    got = _ONES.get(n)
    if got is None:
        if len(_ONES) >= 64:
            _ONES.clear()
        ones, starts = np.ones(n, np.int64), np.arange(n, dtype=np.int64)
        ones.flags.writeable = starts.flags.writeable = False
        got = _ONES[n] = (ones, starts)
    return got


def append_pool(
    pool: Pool,
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[SeqId],
    sel: np.ndarray | None,
    rows: np.ndarray,
    cnt: np.ndarray,
    starts: np.ndarray,
    toks: array | None,
    tk: np.ndarray | None,
    mark: bool,
    ones: bool,
    out: AppendOutcome,
    late: np.ndarray | None = None,
) -> bool:
    """The items `sel` (all when None; their rows `rows`) of one pool, answered into `out`;
    whether any of them succeeded.

    Two kinds of item run as array operations: in-block appends (inside or exactly filling
    an exclusive partial last block) and plain crossings (the table is full and the tokens
    fit one new block: no copy). Crossings take their blocks in request order, so they run
    as arrays only when no other item of the batch takes blocks and the pool has a plain free
    block for each (no eviction, which would drop a hash out of order with the batch's
    registrations); otherwise they go item by item with the rest. So do items with late ids
    (`late`, per item of the whole batch) and items of sequences whose late ids are pending."""
    c, st = (cnt, starts) if sel is None else (cnt[sel], starts[sel])
    lt = None if late is None else late if sel is None else late[sel]
    nt0 = pool.cols.num_tokens_np[rows]
    off, last, end, fast, odd = _masks(pool, rows, nt0, c, ones, lt)
    nt1 = nt0 + c
    simple, cross, light, num_fast = _apply_simple(pool, seqs, seq_ids, sel, rows, nt0, c, off, last, fast, odd,
                                                   nt1, ones, mark)
    hf = simple & (pool.cols.hashing_np[rows] != 0)
    per_item = ~simple
    filled: np.ndarray | None = None
    if tk is None:
        post = hf   # array items that stop hashing (no ids), in request order with the rest
    elif hf.any():
        _scatter_tails(pool, rows, c, st, off, hf, tk, ones)
        post = filled = hf & (end == pool.block_size)
    else:
        post = hf
    num_tokens = nt1.tolist()
    any_ok = num_fast > 0 or bool(cross) or light is not None
    req = sel.tolist() if sel is not None else None
    todo_mask = per_item | post if light is None else per_item | post | light
    if filled is not None and not per_item.any() and light is None:
        # Only blocks that filled inside their tails: hash them straight from the columns.
        f = filled.nonzero()[0]
        if len(f):
            _hash_filled(pool, seqs, seq_ids, f.tolist() if req is None else [req[j] for j in f.tolist()], rows[f])
    elif todo_mask.any():
        todo = todo_mask.nonzero()[0].tolist()
        expected = _expected_takes(pool.block_size, c, per_item, ones)
        if light is not None:
            expected += int(np.count_nonzero(light))
        run = FreeRun(pool, expected) if expected >= RUN_MIN_BLOCKS else None
        try:
            if _run_items(pool, seqs, seq_ids, req, todo, c, st, post, light, lt, toks, tk is None, mark, out,
                          num_tokens, run):
                any_ok = True
        finally:
            if run is not None:
                run.close()
    if req is None:
        out.num_tokens = num_tokens
    else:
        for j, i in enumerate(req):
            out.num_tokens[i] = num_tokens[j]
    return any_ok


# Below this many blocks taken item by item, the items take them one `take_block` at a time:
# popping them up front costs the bookkeeping of a `FreeRun` (pool.py) for little gain.
RUN_MIN_BLOCKS = 4


def _expected_takes(bs: int, c: np.ndarray, per_item: np.ndarray, ones: bool) -> int:
    """At most the blocks the items `per_item` take: an item of `k` tokens gains at most
    `k // bs + 1` blocks, plus a copy-on-write destination. (A bound, cheap to compute: the
    blocks a `FreeRun` pops beyond what is used go back, in order.)"""
    k = int(np.count_nonzero(per_item))
    if not k:
        return 0
    return 2 * k if ones else 2 * k + int((c[per_item] // bs).sum())


def _masks(pool: Pool, rows: np.ndarray, nt0: np.ndarray, c: np.ndarray, ones: bool,
           lt: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Per item: its offset in its last block, that block, where the append ends in it,
    whether it is in-block (`fast`), and which items must go item by item for their late ids
    (`odd`; None: none)."""
    cols = pool.cols
    bs = pool.block_size
    off = nt0 % bs
    last = cols.last_block_np[rows]
    if ones:
        end = off + 1
        fast = (off != 0) & (pool.ref_np[last] == 1)
    else:
        end = off + c
        fast = (off != 0) & (end <= bs) & (pool.ref_np[last] == 1)
    odd: np.ndarray | None = cols.num_late_np[rows] != 0
    if lt is not None:
        odd = odd | (lt != 0)
    if odd is not None and odd.any():
        fast &= ~odd
    else:
        odd = None
    return off, last, end, fast, odd


def _apply_simple(pool: Pool, seqs: dict[SeqId, Sequence], seq_ids: Seq[SeqId], sel: np.ndarray | None,
                  rows: np.ndarray, nt0: np.ndarray, c: np.ndarray, off: np.ndarray, last: np.ndarray,
                  fast: np.ndarray, odd: np.ndarray | None, nt1: np.ndarray, ones: bool,
                  mark: bool) -> tuple[np.ndarray, list[int], np.ndarray | None, int]:
    """Apply the in-block appends, and the plain crossings' columns: (the items done as arrays,
    the crossings done here, the crossings left to the request-ordered loop, the number of
    in-block items).

    Crossings take their blocks in request order. When every other item is in-block they take
    them here, in one pop. When other items take blocks too, the crossings' counts,
    writing steps and tails are still written here, but their blocks are taken in the
    request-ordered loop with the others (`light`: a table append each, no `append_one`) — as
    long as every block of the batch comes from the plain free list: an eviction drops a hash,
    which must happen in request order relative to the registrations of blocks that fill."""
    cols = pool.cols
    num = len(rows)
    step_id = pool.step.step_id
    num_fast = int(np.count_nonzero(fast))
    simple = fast
    cross: list[int] = []
    light: np.ndarray | None = None
    if num_fast < num:
        crossing = (off == 0) if ones else (off == 0) & (c <= pool.block_size)
        if odd is not None:
            crossing &= ~odd
        num_cross = int(np.count_nonzero(crossing))
        if num_cross and num_fast + num_cross == num and num_cross <= pool.free_list.length:
            simple = fast | crossing
            cross = crossing.nonzero()[0].tolist()
        elif num_cross:
            rest = ~(fast | crossing)
            if num_cross + _expected_takes(pool.block_size, c, rest, ones) <= pool.free_list.length:
                simple = fast | crossing
                light = crossing
    if num_fast == num or cross or light is not None:
        # Every item done here: one scatter each for all of them (a crossing's new count and
        # writing step are the same; only its block differs).
        rs = rows if light is None else rows[simple]
        cols.num_tokens_np[rs] = nt1 if light is None else nt1[simple]
        if mark:
            pool.write_step_np[last if num_fast == num else last[fast]] = step_id
            cols.last_write_step_np[rs] = step_id
        if cross:
            _cross(pool, seqs, seq_ids, sel, rows, cross, step_id)
    elif num_fast:
        rs = rows[fast]
        cols.num_tokens_np[rs] = nt1[fast]
        if mark:
            pool.write_step_np[last[fast]] = step_id
            cols.last_write_step_np[rs] = step_id
    return simple, cross, light, num_fast


def _scatter_tails(pool: Pool, rows: np.ndarray, c: np.ndarray, st: np.ndarray, off: np.ndarray, hf: np.ndarray,
                   tk: np.ndarray, ones: bool) -> None:
    """Write the token ids of the hashing items done as arrays into their tails."""
    cols = pool.cols
    bs = pool.block_size
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


def _run_items(pool: Pool, seqs: dict[SeqId, Sequence], seq_ids: Seq[SeqId], req: list[int] | None, todo: list[int],
               c: np.ndarray, st: np.ndarray, post: np.ndarray, light: np.ndarray | None, lt: np.ndarray | None,
               toks: array | None, no_ids: bool, mark: bool, out: AppendOutcome, num_tokens: list[int],
               run: FreeRun | None) -> bool:
    """The items `todo` one by one in request order: a crossing left to this loop (`light`)
    takes its block; an array item whose block filled (`post`) gets hashed (or stops hashing
    without ids); any other runs `append_one`. Blocks come from `run` when given. Whether one
    of the `append_one` items succeeded."""
    any_ok = False
    cl, sl, pl = c.tolist(), st.tolist(), post.tolist()
    ll = lt.tolist() if lt is not None else None
    lm = light.tolist() if light is not None else None
    take = pool.take_block if run is None else run.take
    step = pool.step
    dirty = step.dirty
    step_id = step.step_id
    for j in todo:
        i = j if req is None else req[j]
        seq = seqs[seq_ids[i]]
        if lm is not None and lm[j]:   # a plain crossing: one new block (its columns are written)
            if seq.seq_id not in dirty:
                touch(step, seq)
            b = take()
            seq.block_table.append(b)
            seq.version = pool.new_version()
            seq.last_step = step_id
            pool.cols.last_block[seq.row] = b
            pool.write_step[b] = step_id
            if not pl[j]:
                continue
        if pl[j]:
            if no_ids:
                stop_hashing(seq)
            else:   # its block filled: hash it
                hash_full_row(pool, seq)
            continue
        k, p = cl[j], sl[j]
        try:
            _, op = append_one(pool, seq, k, None if toks is None else toks[p : p + k], mark,
                               0 if ll is None else ll[j], run)
        except CoreError as exc:
            out.failures.append((i, exc))
            num_tokens[j] = 0
            continue
        any_ok = True
        if op is not None:
            out.copy_ops[i] = op
    return any_ok


def _cross(
    pool: Pool,
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[SeqId],
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
    version = pool.last_version
    req = sel.tolist() if sel is not None else None
    taken = pool.take_free_many(len(cross))   # in request order, as `take_block` would
    for j, b in zip(cross, taken):
        seq = seqs[seq_ids[j if req is None else req[j]]]
        if seq.seq_id not in dirty:
            touch(step, seq)
        seq.block_table.append(b)
        version += 1
        seq.version = version
        seq.last_step = step_id
    pool.last_version = version
    step.has_writes = True
    blocks = np.array(taken, np.int64)
    pool.cols.last_block_np[rows[cross]] = blocks
    pool.write_step_np[blocks] = step_id


_BLOCK_STRUCTS: dict[int, struct.Struct] = {}


def _block_struct(block_size: int) -> struct.Struct:
    """The little-endian int64 layout of one block's token ids (cached per block size)."""
    got = _BLOCK_STRUCTS.get(block_size)
    if got is None:
        got = _BLOCK_STRUCTS[block_size] = struct.Struct(f"<{block_size}q")
    return got


def _hash_filled(pool: Pool, seqs: dict[SeqId, Sequence], seq_ids: Seq[SeqId], items: list[int],
                 rows: np.ndarray) -> None:
    """Hash and register the blocks the items' tails just filled, in request order (no other
    item of the batch touches the prefix index)."""
    if not _LITTLE_ENDIAN:
        for i in items:
            hash_full_row(pool, seqs[seq_ids[i]])
        return
    cols = pool.cols
    data = cols.tail_np[rows].tobytes()
    cols.tail_len_np[rows] = 0
    bs = pool.block_size
    width = 8 * bs
    tokens_at = _block_struct(bs).unpack_from   # a block's ids as the tuple its BlockMeta keeps
    size = bs.to_bytes(4, "little")
    regs = pool.step.registrations
    index = pool.prefix_index
    meta = pool.meta
    kv_log = pool.kv_log
    for j, i in enumerate(items):
        seq = seqs[seq_ids[i]]
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else None
        salt = seq.salt
        h = hash_encoded(parent, _NO_SALT if salt is None else salt_bytes(salt), size,
                         data[j * width : (j + 1) * width])
        b = seq.block_table[len(hashes)]
        if h not in index and meta[b] is None:   # `Pool.register`, inlined: the first block keeps a hash
            index[h] = b
            m = meta[b] = _new_meta(BlockMeta, (h, parent, salt, tokens_at(data, j * width)))
            regs.append((b, h))
            if kv_log is not None:
                kv_log.stored(m)
        hashes.append(h)


__all__ = ["RUN_MIN_BLOCKS", "append_pool", "decode_arrays"]
