"""Per-sequence state: the hot fields in a pool's columns (flat numpy arrays, one row per
sequence), the rest in one slotted object.

The batched append (append.py) reads and writes the columns for the whole batch at once:
token counts, the last block id, the step that last wrote the sequence, whether it hashes,
and the tokens of its partial last block. Everything else (the block table, block hashes,
version, salt) changes only when a table grows or is rewritten, which is per item anyway.
A `Sequence` is a view over its row with the same attribute names the object-based core
had, so the rare paths (fork, defrag, snapshots, fsck) read it as before.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import numpy as np

from block_manager.core.errors import LateIdsPending, VersionConflict
from block_manager.core.hashing import BlockHash
from block_manager.core.types import PoolId, SeqId, SequenceView

_INITIAL_ROWS = 64
_COLUMNS = ("num_tokens", "last_block", "last_write_step", "hashing", "tail_len", "tail", "num_late")


class SeqColumns:
    """One pool's per-sequence hot state, row-indexed; rows of dropped sequences are reused
    (last freed first, so the layout is a pure function of the call sequence).

    Each column is a flat stdlib int64 `array` (what per-item code indexes: as cheap as a
    list) with a numpy view over the same memory (`*_np`, what the batched append uses).
    `tail[row * block_size :][: tail_len[row]]` holds the tokens of the last block not hashed
    yet while the sequence hashes: the partial last block (`tail_len == num_tokens %
    block_size`), or a full one whose last `num_late[row]` ids are still to come (late ids,
    see append_item.py; `tail_len == block_size` then). fsck checks both."""

    __slots__ = ("block_size", "capacity", "row_of", "_free_rows", "_next_row",
                 *_COLUMNS, *(f"{name}_np" for name in _COLUMNS))

    # set by `_resize` (one loop over _COLUMNS): the stdlib arrays and their numpy views
    num_tokens: array
    last_block: array
    last_write_step: array
    hashing: array
    tail_len: array
    tail: array
    num_late: array
    num_tokens_np: np.ndarray
    last_block_np: np.ndarray
    last_write_step_np: np.ndarray
    hashing_np: np.ndarray
    tail_len_np: np.ndarray
    tail_np: np.ndarray
    num_late_np: np.ndarray

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.row_of: dict[SeqId, int] = {}   # the pool's sequences' rows (a batch maps ids in C)
        self.capacity = 0
        self._free_rows: list[int] = []
        self._next_row = 0
        self._resize(_INITIAL_ROWS)

    def _resize(self, capacity: int) -> None:
        """New, larger arrays (an array with a live numpy view cannot grow in place)."""
        bs = self.block_size
        for name in _COLUMNS:
            width = bs if name == "tail" else 1
            arr = array("q", bytes(8 * width * capacity))
            if self.capacity:
                old = getattr(self, name)
                arr[: len(old)] = old
            setattr(self, name, arr)
            view = np.frombuffer(arr, dtype=np.int64)
            setattr(self, f"{name}_np", view.reshape(capacity, bs) if name == "tail" else view)
        self.capacity = capacity

    def new_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        if self._next_row == self.capacity:
            self._resize(2 * self.capacity)
        row = self._next_row
        self._next_row += 1
        return row

    def free_row(self, seq_id: SeqId, row: int) -> None:
        del self.row_of[seq_id]
        self.num_tokens[row] = 0
        self.hashing[row] = 0
        self.tail_len[row] = 0
        self.num_late[row] = 0
        self._free_rows.append(row)


class Sequence:
    """One generation stream pinned to one pool (see the module docstring for where each
    field lives).

    `block_hashes[i]` is the chained hash of logical block i; it is kept for every full
    block while `hashing` is on (even when another physical block owns that hash in the
    prefix index) because the next block's hash chains from it (but a full last block whose
    `num_late` ids are still to come). `tail_token_ids` are the tokens of the last block not
    hashed yet, the only content still needed to hash it. `hashing` turns off for good when an
    append arrives without token ids.
    `last_write_step` is the last step that gave it tokens to write; while that step is still
    open the sequence cannot be freed (its writes, which forks and prefix hits of this step may
    share, would never happen). `last_step` is the last step that created it or changed its
    table. A failure of either step leaves the sequence inconsistent on its node, so it is
    dropped then (`last_touched_step`). Two fields so the hot in-block append stores one.
    """

    __slots__ = ("seq_id", "pool_id", "block_table", "version", "salt", "block_hashes", "last_step",
                 "row", "cols")

    def __init__(
        self,
        seq_id: SeqId,
        pool_id: PoolId,
        block_table: list[int],
        num_tokens: int,
        version: int,
        salt: str | None,
        hashing: bool,
        tail_token_ids: Seq[int] = (),
        block_hashes: list[BlockHash] | None = None,
        last_step: int = 0,
        last_write_step: int = 0,
        num_late: int = 0,
        *,
        cols: SeqColumns,
    ) -> None:
        self.seq_id = seq_id
        self.pool_id = pool_id
        self.block_table = block_table
        self.version = version
        self.salt = salt
        self.block_hashes = block_hashes if block_hashes is not None else []
        self.last_step = last_step
        self.cols = cols
        row = self.row = cols.new_row()
        cols.row_of[seq_id] = row
        cols.num_tokens[row] = num_tokens
        cols.last_block[row] = block_table[-1] if block_table else 0
        cols.last_write_step[row] = last_write_step
        cols.hashing[row] = 1 if hashing else 0
        self.tail_token_ids = tail_token_ids
        cols.num_late[row] = num_late

    def release(self) -> None:
        """The sequence is gone: its row may be reused."""
        self.cols.free_row(self.seq_id, self.row)

    def sync_last_block(self) -> None:
        """Call after the table's last entry changed (a new block, copy-on-write, a move)."""
        self.cols.last_block[self.row] = self.block_table[-1]

    @property
    def num_tokens(self) -> int:
        return self.cols.num_tokens[self.row]

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self.cols.num_tokens[self.row] = value

    @property
    def last_write_step(self) -> int:
        return self.cols.last_write_step[self.row]

    @last_write_step.setter
    def last_write_step(self, value: int) -> None:
        self.cols.last_write_step[self.row] = value

    @property
    def hashing(self) -> bool:
        return bool(self.cols.hashing[self.row])

    @hashing.setter
    def hashing(self, value: bool) -> None:
        self.cols.hashing[self.row] = 1 if value else 0

    @property
    def tail_token_ids(self) -> list[int]:
        """A copy (mutating it changes nothing; assign to change the tail)."""
        cols = self.cols
        start = self.row * cols.block_size
        return cols.tail[start : start + cols.tail_len[self.row]].tolist()

    @tail_token_ids.setter
    def tail_token_ids(self, tokens: Seq[int]) -> None:
        cols = self.cols
        k = len(tokens)
        if k > cols.block_size:
            raise ValueError(f"sequence {self.seq_id!r}: {k} tail tokens exceed a block of {cols.block_size}")
        if k:
            start = self.row * cols.block_size
            try:
                cols.tail[start : start + k] = array("q", tokens)
            except OverflowError:
                raise ValueError(f"sequence {self.seq_id!r}: a tail token is not an int64") from None
        cols.tail_len[self.row] = k

    @property
    def num_late(self) -> int:
        """Tokens at the end of the tail whose ids the scheduler has not sent yet (late ids)."""
        return self.cols.num_late[self.row]

    @num_late.setter
    def num_late(self, value: int) -> None:
        self.cols.num_late[self.row] = value

    @property
    def last_touched_step(self) -> int:
        """The last step whose failed Forward would leave the sequence inconsistent."""
        return max(self.last_step, self.last_write_step)

    def view(self) -> SequenceView:
        return SequenceView(
            self.seq_id, self.pool_id, tuple(self.block_table),  # type: ignore[arg-type]  # block ids are plain ints at run time (BlockId is a NewType)
            self.num_tokens, self.version,
        )


def late_pending(seq: Sequence) -> LateIdsPending | None:
    """The refusal of anything but a free for a sequence whose late ids are still to come
    (append_item.py): an append, a fork, a swap-out, an already-written report."""
    pending = seq.num_late
    if not pending:
        return None
    return LateIdsPending(
        f"sequence {seq.seq_id!r}: the ids of its last {pending} tokens are still to come; send them "
        "(the Step's late ids) before anything else touches it"
    )


def newer_views(seqs: list[Sequence], known: Mapping[SeqId, int]) -> list[SequenceView]:
    """Views of `seqs` whose table is newer than the caller's `known` version
    (`BlockManager.get_tables`); `VersionConflict` for a caller ahead of the core."""
    out: list[SequenceView] = []
    for seq in seqs:
        have = known.get(seq.seq_id)
        if have is not None and have > seq.version:
            raise VersionConflict(f"sequence {seq.seq_id!r}: caller has version {have}, core {seq.version}")
        if have is None or have < seq.version:
            out.append(seq.view())
    return out
