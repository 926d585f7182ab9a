"""The batched append, item by item: what a small batch runs for every item and a large one
for the items the arrays do not cover (copy-on-write, several new blocks at once, blocks that
fill and get hashed). Reads and writes the pool's sequence columns through their stdlib
arrays, whose per-item indexing is as cheap as a list's (see sequence.py)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from block_manager.core.errors import CoreError, OutOfBlocks, PendingWrite
from block_manager.core.hashing import hash_block_bytes, salt_bytes
from block_manager.core.pool import Pool
from block_manager.core.sequence import Sequence
from block_manager.core.steps import touch
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


def stop_hashing(seq: Sequence) -> None:
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


def append_one(pool: Pool, seq: Sequence, n: int, toks: Seq[int] | None, mark: bool) -> tuple[int, CopyOp | None]:
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
                rest = _hash_tail(pool, seq, [*cols.tail[base : base + k], *toks])
                seq.tail_token_ids = rest
    return nt, op


def append_items(
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
        else:
            try:
                nt, op = append_one(pool, seq, n, None if toks is None else toks[pos : pos + n], mark)
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


def hash_full_row(pool: Pool, seq: Sequence) -> None:
    """The sequence's tail just filled its last block: hash and register that block."""
    cols = pool.cols
    base = seq.row * pool.block_size
    _hash_tail(pool, seq, cols.tail[base : base + pool.block_size].tolist())
    cols.tail_len[seq.row] = 0


__all__ = ["AppendOutcome", "append_items", "append_one", "hash_full_row", "stop_hashing"]
