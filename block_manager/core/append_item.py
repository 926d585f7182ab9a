"""The batched append, item by item: what a small batch runs for every item and a large one
for the items the arrays do not cover (copy-on-write, several new blocks at once, blocks that
fill and get hashed, late ids). Reads and writes the pool's sequence columns through their
stdlib arrays, whose per-item indexing is as cheap as a list's (see sequence.py).

Late ids (why): a scheduler that plans step N+1 while step N runs (async scheduling) appends
the token step N samples before it knows that token's id. Inside a partial block the id is
not needed yet, but an append that starts or fills a block must reach the block manager, and
a block can only be hashed once all its ids are known. So an append may say that its last
`num_late` tokens' ids come later: they must all lie in the sequence's last block, their
slots are assigned as usual, and the block that holds them is not hashed. The scheduler
sends the ids with its next Step (`resolve_late`, before any other section touches the
sequence); a full block is hashed then, its registration recorded in the step that wrote it
(a failure of that step unregisters it, as for a block hashed at once). Until then the
sequence takes no other append, fork, swap-out or already-written report.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from block_manager.core.errors import CoreError, InvalidRequest, OutOfBlocks, PendingWrite
from block_manager.core.hashing import hash_block_bytes, salt_bytes
from block_manager.core.pool import FreeRun, Pool
from block_manager.core.sequence import Sequence, late_pending
from block_manager.core.step_work import touch
from block_manager.core.types import CopyOp, PoolId, SeqId


@dataclass(slots=True)
class AppendOutcome:
    """What a batched append did: per item, the sequence's token count after it (0 for a
    failed item), the failed items (index, error; that sequence is unchanged), and the
    copy-on-write op of each item that needed one."""

    num_tokens: list[int]
    failures: list[tuple[int, CoreError]] = field(default_factory=list)
    copy_ops: dict[int, CopyOp] = field(default_factory=dict)


def _pending(seq: Sequence, block: int, pool: Pool) -> PendingWrite:
    return PendingWrite(
        f"sequence {seq.seq_id!r}: copy-on-write of block {block}, written in step {pool.write_step[block]} "
        f"whose Forward is not reported yet (settled up to step {pool.settled_step})"
    )


def _hash_tail(pool: Pool, seq: Sequence, tail: list[int], late: int = 0,
               registrations: list[tuple[int, bytes]] | None = None) -> list[int]:
    """Hash and register every full block at the front of `tail` (each chained on the
    previous one) but a last one that holds `late` tokens; returns the tokens left over (the
    new partial block, or that full block). Registrations go to the open step unless
    `registrations` names the record of the step that wrote the blocks."""
    bs = pool.block_size
    salt_enc = salt_bytes(seq.salt)
    hashes = seq.block_hashes
    table = seq.block_table
    regs = pool.step.registrations if registrations is None else registrations
    start = 0
    while len(tail) - start > bs or (len(tail) - start == bs and not late):
        block_tokens = tuple(tail[start : start + bs])
        start += bs
        parent = hashes[-1] if hashes else None
        h = hash_block_bytes(parent, array("q", block_tokens), salt_enc)
        b = table[len(hashes)]
        if pool.register(b, h, parent, seq.salt, block_tokens):
            regs.append((b, h))
        hashes.append(h)
    return tail[start:]


def stop_hashing(seq: Sequence) -> None:
    """Content unknown from here on: the chain cannot continue."""
    cols = seq.cols
    cols.hashing[seq.row] = 0
    cols.tail_len[seq.row] = 0
    cols.num_late[seq.row] = 0
    seq.block_hashes = []


def late_error(pool: Pool, seq: Sequence, n: int, late: int) -> CoreError | None:
    """Why an append of `n` tokens, the last `late` of them without ids, may not run now."""
    pending = late_pending(seq)
    if pending is not None:
        return pending
    if late:
        bs = pool.block_size
        in_last = (seq.num_tokens + n - 1) % bs + 1
        if late > n or late > in_last:
            return InvalidRequest(
                f"sequence {seq.seq_id!r}: {late} late ids for {n} new tokens; they must all lie in its "
                f"last block ({in_last} of its tokens there after the append)"
            )
    return None


def _registrations_of(pool: Pool, step_id: int) -> list[tuple[int, bytes]]:
    """Where a hash of a block written in `step_id` is recorded: that step's, so a failure
    report of it unregisters the hash (the open step's once it is settled)."""
    for record in pool.unsettled:
        if record.step_id == step_id:
            return record.registrations
    return pool.step.registrations


def resolve_late(pool: Pool, seq: Sequence, token_ids: Seq[int]) -> None:
    """The ids of the sequence's late tokens (module docstring): written into its tail, and
    its last block hashed if full. Raises `InvalidRequest` with nothing changed. A sequence
    that no longer hashes needs no ids: they are accepted and dropped."""
    cols = pool.cols
    row = seq.row
    if not cols.hashing[row]:
        return
    k = cols.num_late[row]
    if len(token_ids) != k:
        raise InvalidRequest(f"sequence {seq.seq_id!r}: {len(token_ids)} late ids, {k} tokens await theirs")
    if not k:
        return
    bs = pool.block_size
    base = row * bs
    tl = cols.tail_len[row]
    cols.tail[base + tl - k : base + tl] = array("q", token_ids)
    cols.num_late[row] = 0
    if tl == bs:
        block = seq.block_table[len(seq.block_hashes)]
        hash_full_row(pool, seq, _registrations_of(pool, pool.write_step[block]))


def _grow(pool: Pool, seq: Sequence, n: int, run: FreeRun | None = None) -> CopyOp | None:
    """The general append: new blocks at block boundaries, copy-on-write of a shared partial
    last block (only once the step that wrote it is settled). Raises with nothing changed.
    `run`: the batch's blocks taken up front (pool.py), used in place of `take_block`."""
    bs = pool.block_size
    table = seq.block_table
    cols = pool.cols
    row = seq.row
    old = cols.num_tokens[row]
    new = old + n
    off = old % bs
    num_new_blocks = (new + bs - 1) // bs - len(table)
    cow = off != 0 and pool.ref_cnt[table[-1]] > 1
    available = pool.num_available if run is None else run.available
    if num_new_blocks + cow > available:
        raise OutOfBlocks(
            f"pool {seq.pool_id!r}: sequence {seq.seq_id!r} needs {num_new_blocks + cow} blocks, "
            f"{available} available"
        )
    write_step = pool.write_step
    if cow and write_step[table[-1]] > pool.settled_step:
        raise _pending(seq, table[-1], pool)
    step = pool.step
    step_id = step.step_id
    dirty = touch(step, seq)
    op = None
    take = pool.take_block if run is None else run.take
    if cow:
        src = table[-1]
        dst = take()
        table[-1] = dst
        pool.release_block(src)
        op = pool.add_copy_op(src, dst, "cow")
        pool.cow_copies += 1
        if len(table) - 1 < dirty.base_len and not dirty.created:
            dirty.replaced.add(len(table) - 1)
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


def append_one(pool: Pool, seq: Sequence, n: int, toks: Seq[int] | None, mark: bool,
               late: int = 0, run: FreeRun | None = None) -> tuple[int, CopyOp | None]:
    """One item of a batch, alone: the sequence's token count after it and its copy-on-write
    op; its last `late` tokens' ids come later (module docstring; their entries in `toks` are
    placeholders). Raises a `CoreError` with nothing changed. Reads and writes the columns'
    stdlib arrays (per-item indexing of those is as cheap as a list's)."""
    cols = pool.cols
    row = seq.row
    bs = pool.block_size
    err = late_error(pool, seq, n, late) if late or cols.num_late[row] else None
    if err is not None:
        raise err
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
        op = _grow(pool, seq, n, run)
        nt += n
    if cols.hashing[row]:
        if toks is None:
            stop_hashing(seq)
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
                rest = _hash_tail(pool, seq, [*cols.tail[base : base + k], *toks], late)
                seq.tail_token_ids = rest
            cols.num_late[row] = late
    return nt, op


def append_items(
    pools: dict[PoolId, Pool],
    seqs: dict[SeqId, Sequence],
    seq_ids: Seq[SeqId],
    counts: Seq[int],
    toks: array | None,
    mark: bool,
    late: Seq[int] | None = None,
) -> AppendOutcome:
    """A small batch, item by item, kept flat: the per-token cost of a Step that carries only
    the sequences crossing a block. `late[i]`: item i's late ids."""
    out = AppendOutcome([])
    push = out.num_tokens.append
    get = seqs.__getitem__
    touched: list[Pool] = []
    last_pid, pos, i = None, 0, -1
    for sid, n in zip(seq_ids, counts):
        i += 1
        seq: Sequence = get(sid)
        pid = seq.pool_id
        if pid is not last_pid:   # the pool's columns as locals (the loop is per token of a Step)
            last_pid = pid
            pool = pools[pid]
            touched.append(pool)
            bs, ref, write_step, step_id, cols = (pool.block_size, pool.ref_cnt, pool.write_step,
                                                  pool.step.step_id, pool.cols)
            ntc, lbc, lwc, hc, tail, lc = (cols.num_tokens, cols.last_block, cols.last_write_step, cols.hashing,
                                           cols.tail, cols.num_late)
        row = seq.row
        nt = ntc[row]
        off = nt % bs
        k_late = 0 if late is None else late[i]
        if off and off + n <= bs and ref[last := lbc[row]] == 1 and not (k_late or lc[row]):
            # Inside (or exactly filling) an exclusive partial block: same table, no copy.
            nt += n
            ntc[row] = nt
            if mark:
                write_step[last] = step_id
                lwc[row] = step_id
            if hc[row]:
                if toks is None:
                    stop_hashing(seq)
                else:   # the tail holds `off` tokens (the partial block's)
                    at = row * bs + off
                    if n == 1:
                        tail[at] = toks[pos]
                    else:
                        tail[at : at + n] = toks[pos : pos + n]
                    if off + n == bs:
                        hash_full_row(pool, seq)
                    else:
                        cols.tail_len[row] = off + n
        else:   # 0: failed (listed in `out`)
            nt = _append_general(pool, seq, i, n, None if toks is None else toks[pos : pos + n], mark, k_late, out)
        pos += n
        push(nt)
    count_steps(_with_tokens(seqs, seq_ids, out, touched) if out.failures else set(touched), mark)
    return out


def _with_tokens(seqs: dict[SeqId, Sequence], seq_ids: Seq[SeqId], out: AppendOutcome,
                 touched: list[Pool]) -> set[Pool]:
    """The pools among `touched` that got tokens (one whose every item failed is unchanged)."""
    ok = {seqs[SeqId(sid)].pool_id for sid, nt in zip(seq_ids, out.num_tokens) if nt}
    return {p for p in touched if p.pool_id in ok}


def _append_general(pool: Pool, seq: Sequence, i: int, n: int, toks: Seq[int] | None, mark: bool, late: int,
                    out: AppendOutcome) -> int:
    """Item i by `append_one`: its token count after, or 0 with its error listed in `out`."""
    try:
        nt, op = append_one(pool, seq, n, toks, mark, late)
    except CoreError as exc:
        out.failures.append((i, exc))
        return 0
    if op is not None:
        out.copy_ops[i] = op
    return nt


def count_steps(pools: Iterable[Pool], mark: bool) -> None:
    """One scheduler step for each pool that got tokens (the defrag policy's cadence)."""
    for p in pools:
        p.num_steps += 1
        if mark:
            p.step.has_writes = True


def hash_full_row(pool: Pool, seq: Sequence, registrations: list[tuple[int, bytes]] | None = None) -> None:
    """The sequence's tail fills its last block: hash and register that block (in the open
    step, or in `registrations`: see `_hash_tail`)."""
    cols = pool.cols
    bs = pool.block_size
    base = seq.row * bs
    block = cols.tail[base : base + bs]   # (an int64 array: hashed as it is, no list in between)
    hashes = seq.block_hashes
    parent = hashes[-1] if hashes else None
    h = hash_block_bytes(parent, block, salt_bytes(seq.salt))
    b = seq.block_table[len(hashes)]
    if pool.register(b, h, parent, seq.salt, tuple(block)):
        (pool.step.registrations if registrations is None else registrations).append((b, h))
    hashes.append(h)
    cols.tail_len[seq.row] = 0


__all__ = ["AppendOutcome", "append_items", "append_one", "hash_full_row", "late_error", "resolve_late",
           "stop_hashing"]
