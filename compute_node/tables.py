"""The node's block tables, kept current by the block manager's steps (no RPC on the hot path).

Each Forward carries the steps of this node's pool since its previous Forward (`PoolStep`): the
copy ops to run before the step's writes, the table deltas and the dropped sequences. The node
applies them in order to its own tables; it never asks the block manager for a table in steady
state. Per sequence it also keeps `num_tokens`, the positions its table holds K/V for (written,
or being written by the current Forward): a Forward may only write at exactly that tail.

`stage` validates a Forward's steps against the cache *without* changing it (a bad Forward
leaves the node untouched); `StagedSteps.commit` applies them once everything is checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from compute_node.errors import InvalidForward, NodeFenced, StaleStep, StaleTable, UnknownSequence
from pagedkv.tiers import TierKind

SeqId = NewType("SeqId", str)


@dataclass(slots=True)
class NodeTable:
    """One sequence on this node: its table, the table's version, the positions it holds."""

    block_table: list[int]
    version: int
    num_tokens: int


@dataclass(slots=True)
class StagedSteps:
    """The effect of a Forward's steps, checked but not yet applied."""

    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    num_defrag_copies: int = 0
    changed: dict[SeqId, NodeTable | None] = field(default_factory=dict)   # None: dropped
    reset: bool = False
    last_step_id: int | None = None
    # host tier moves per step, in step order: (copy pairs staged before them, device->host
    # pairs, host->device pairs); applied by compute_node.host_pool.apply_moves
    tier_moves: list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]] = field(default_factory=list)
    # the disk tier's moves of the same steps (index for index): (host->disk (host block, slot,
    # identity), disk->host (slot, host block)); applied around the host tier's moves
    disk_moves: list[tuple[list[tuple[int, int, Any]], list[tuple[int, int]]]] = field(default_factory=list)
    # prefix fetch (compute_node/transfer.py): KvFetch ops to pull inside the step, KvServe
    # grants to serve from it on (docs/prefix_fetch.md)
    fetches: list[Any] = field(default_factory=list)
    serves: list[Any] = field(default_factory=list)
    # per fetch op (index for index): where its step ends in the order the node runs the
    # Forward's work, `(copy pairs staged through its step, tier_moves entries staged through
    # it)`; its blocks land there, after its step's moves and copies, before any later step's
    fetch_marks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end_mark(self) -> tuple[int, int]:
        """The mark after every move and copy of the Forward."""
        return len(self.copy_pairs), len(self.tier_moves)

    def lands_last(self, i: int) -> bool:
        """Fetch op `i` comes after every tier move and copy the Forward carries (its step is
        the last with any): pulling it after they have all run keeps the step order."""
        return self.fetch_marks[i] == self.end_mark

    def table(self, cache: TableCache, seq_id: SeqId) -> NodeTable | None:
        if seq_id in self.changed:
            return self.changed[seq_id]
        return None if self.reset else cache.get(seq_id)


class TableCache:
    """Tables of the sequences this node serves, plus the last step applied."""

    def __init__(self) -> None:
        self._tables: dict[SeqId, NodeTable] = {}
        self.last_step_id = 0

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, seq_id: SeqId) -> NodeTable | None:
        return self._tables.get(seq_id)

    def put(self, seq_id: SeqId, table: NodeTable) -> None:
        self._tables[seq_id] = table

    def drop(self, seq_ids: Iterable[SeqId]) -> None:
        for seq_id in seq_ids:
            self._tables.pop(seq_id, None)

    def clear(self) -> None:
        """A new registration (epoch): nothing of the old pool is valid."""
        self._tables.clear()
        self.last_step_id = 0

    def commit(self, staged: StagedSteps) -> None:
        if staged.reset:
            self._tables.clear()
        for seq_id, table in staged.changed.items():
            if table is None:
                self._tables.pop(seq_id, None)
            else:
                self._tables[seq_id] = table
        if staged.last_step_id is not None:
            self.last_step_id = staged.last_step_id


def stage(cache: TableCache, steps: Sequence[Any], node_id: str, epoch: int, num_blocks: int,
          host_num_blocks: int = 0, disk_num_blocks: int = 0) -> StagedSteps:
    """Check the steps (`PoolStep` messages) a Forward carries and compute their effect.

    `StaleStep` (FAILED_PRECONDITION) when they do not continue from the node's last applied
    step (a step was skipped: the scheduler must send every step, in order) or belong to an
    earlier epoch, `NodeFenced` for a later epoch (the block manager re-registered the pool),
    `StaleTable` (ABORTED) when a delta does not apply to the node's version of a table,
    `InvalidForward` for malformed columns or a block id outside the pool's `num_blocks` (the
    kernels index the pool without bounds checks, so no such id may reach them).
    """
    staged = StagedSteps()
    last = cache.last_step_id
    for i, m in enumerate(steps):
        if m.pool_id != node_id:
            raise InvalidForward(f"steps[{i}] is for pool {m.pool_id!r}, this node is {node_id!r}")
        if m.epoch > epoch:
            raise NodeFenced(f"steps[{i}] belongs to epoch {m.epoch}: the node's epoch {epoch} was fenced")
        if m.epoch < epoch:
            raise StaleStep(f"steps[{i}] belongs to epoch {m.epoch}, an earlier registration of this node ({epoch})")
        if not m.reset and not m.base_step_id <= last < m.step_id:
            raise StaleStep(
                f"step {m.step_id} builds on step {m.base_step_id}, but the node has applied up to step {last}: "
                "send every step of the pool, in order"
            )
        if m.reset and m.step_id <= last:
            raise StaleStep(f"reset step {m.step_id} is not after the node's last step {last}")
        last = m.step_id
        if m.reset:
            staged.reset = True
            staged.changed.clear()
        _check_blocks(m, i, num_blocks)
        if m.tier_kind:
            _stage_tier_moves(staged, m, i, num_blocks, host_num_blocks, disk_num_blocks)
        _stage_copies(staged, m, i)
        if m.fetches or m.serves:
            _stage_fetches(staged, m, i, num_blocks, host_num_blocks)
        for sid in m.dropped_seq_ids:
            staged.changed[SeqId(sid)] = None
        _stage_deltas(staged, cache, m, i)
    staged.last_step_id = last if steps else None
    return staged


def _stage_fetches(staged: StagedSteps, m: Any, i: int, num_blocks: int, host_num_blocks: int) -> None:
    """A step's prefix fetch ops and serve grants, their block ids checked against the tier
    each names (a grant's host blocks against this node's host tier)."""
    for f in m.fetches:
        if (not f.fetch_id or len(f.src_blocks) != len(f.dst_blocks) or not f.dst_blocks
                or len(f.src_host) not in (0, len(f.src_blocks))):
            raise InvalidForward(f"steps[{i}]: fetch {f.fetch_id!r} needs as many source as destination blocks")
        if max(f.dst_blocks) >= num_blocks:
            raise InvalidForward(f"steps[{i}]: fetch {f.fetch_id!r} names block {max(f.dst_blocks)}; "
                                 f"the pool has {num_blocks} blocks")
        staged.fetches.append(f)
        staged.fetch_marks.append(staged.end_mark)   # staged after the step's moves and copies
    for g in m.serves:
        host = list(g.host) or [False] * len(g.blocks)
        if (not g.fetch_id or not g.blocks or len(host) != len(g.blocks)
                or any(b >= (host_num_blocks if h else num_blocks) for b, h in zip(g.blocks, host))):
            raise InvalidForward(f"steps[{i}]: serve grant {g.fetch_id!r} names no block or one outside its tier")
        staged.serves.append(g)


def _check_blocks(m: Any, i: int, num_blocks: int) -> None:
    for name in ("copy_src", "copy_dst", "replaced_blocks", "appended_blocks"):
        col = getattr(m, name)
        if col and max(col) >= num_blocks:
            raise InvalidForward(f"steps[{i}].{name} names block {max(col)}; the pool has {num_blocks} blocks")


def _stage_tier_moves(staged: StagedSteps, m: Any, i: int, num_blocks: int, host_num_blocks: int,
                      disk_num_blocks: int = 0) -> None:
    """A step's host tier moves (kinds 1 swap-out / 3 offload: device->host; 2 swap-in /
    4 onboard: host->device) and disk tier moves (5 disk offload: host->disk, with its block's
    identity in `disk_blocks`; 6 disk onboard: disk->host), every id checked against the tier
    it names."""
    if not len(m.tier_kind) == len(m.tier_src) == len(m.tier_dst):
        raise InvalidForward(f"steps[{i}]: tier move columns have different lengths")
    to_host: list[tuple[int, int]] = []
    to_device: list[tuple[int, int]] = []
    to_disk: list[tuple[int, int, Any]] = []
    from_disk: list[tuple[int, int]] = []
    identities = list(m.disk_blocks)
    for number, src, dst in zip(m.tier_kind, m.tier_src, m.tier_dst):
        try:
            kind = TierKind(number)
        except ValueError:
            raise InvalidForward(f"steps[{i}]: unknown tier move kind {number}") from None
        if kind.is_disk:
            host, slot = (src, dst) if kind == TierKind.DISK_OFFLOAD else (dst, src)
            if host >= host_num_blocks or slot >= disk_num_blocks:
                raise InvalidForward(
                    f"steps[{i}]: disk move {src}->{dst} names a block outside the tiers ({host_num_blocks} host "
                    f"blocks, {disk_num_blocks} disk slots)")
            if kind == TierKind.DISK_ONBOARD:
                from_disk.append((slot, host))
                continue
            if len(to_disk) >= len(identities) or identities[len(to_disk)].slot != slot:
                raise InvalidForward(f"steps[{i}]: disk offload {src}->{dst} has no matching disk_blocks entry")
            to_disk.append((host, slot, identities[len(to_disk)]))
            continue
        if kind.to_host:
            dev, host, out = src, dst, to_host
        else:   # kind.to_device: the six kinds are disk (above), to-host or to-device
            host, dev, out = src, dst, to_device
        if dev >= num_blocks or host >= host_num_blocks:
            raise InvalidForward(
                f"steps[{i}]: tier move {src}->{dst} names a block outside the pool ({num_blocks} device blocks, "
                f"{host_num_blocks} host blocks)"
            )
        out.append((src, dst))
    if len(to_disk) != len(identities):
        raise InvalidForward(f"steps[{i}]: {len(identities)} disk_blocks for {len(to_disk)} disk offloads")
    staged.tier_moves.append((len(staged.copy_pairs), to_host, to_device))
    staged.disk_moves.append((to_disk, from_disk))


def _stage_copies(staged: StagedSteps, m: Any, i: int) -> None:
    if not len(m.copy_src) == len(m.copy_dst) == len(m.copy_is_defrag):
        raise InvalidForward(f"steps[{i}]: copy columns have different lengths")
    staged.copy_pairs.extend(zip(m.copy_src, m.copy_dst))
    staged.num_defrag_copies += sum(m.copy_is_defrag)


def _stage_deltas(staged: StagedSteps, cache: TableCache, m: Any, i: int) -> None:
    n = len(m.delta_seq_ids)
    cols = (m.delta_base_versions, m.delta_versions, m.delta_num_tokens, m.delta_num_replaced, m.delta_num_appended)
    if any(len(c) != n for c in cols):
        raise InvalidForward(f"steps[{i}]: delta columns have different lengths")
    if sum(m.delta_num_replaced) != len(m.replaced_positions) or len(m.replaced_positions) != len(m.replaced_blocks):
        raise InvalidForward(f"steps[{i}]: replaced entries do not match their counts")
    if sum(m.delta_num_appended) != len(m.appended_blocks):
        raise InvalidForward(f"steps[{i}]: appended blocks do not match their counts")
    rep = app = 0
    for j in range(n):
        sid = SeqId(m.delta_seq_ids[j])
        base, version = m.delta_base_versions[j], m.delta_versions[j]
        nr, na = m.delta_num_replaced[j], m.delta_num_appended[j]
        appended = list(m.appended_blocks[app : app + na])
        if base == 0:
            table = NodeTable(appended, version, m.delta_num_tokens[j])
        else:
            old = staged.table(cache, sid)
            if old is None or old.version != base:
                have = None if old is None else old.version
                raise StaleTable(
                    f"sequence {sid!r}: step {m.step_id} changes table version {base}, the node has {have}"
                )
            blocks = list(old.block_table)
            for pos, block in zip(m.replaced_positions[rep : rep + nr], m.replaced_blocks[rep : rep + nr]):
                if pos >= len(blocks):
                    raise InvalidForward(f"sequence {sid!r}: replaced position {pos} beyond its table")
                blocks[pos] = block
            blocks.extend(appended)
            table = NodeTable(blocks, version, old.num_tokens)
        staged.changed[sid] = table
        rep += nr
        app += na


def check_tail(
    seq_id: str, table: NodeTable | None, start: int, context_len: int, block_size: int, *, lagging: bool = False
) -> NodeTable:
    """The tail rule, one check for Forward and Generate: a step writes a sequence's new tokens
    (positions `start … context_len - 1`) exactly at the tail the node holds, never below it
    (so never into tokens it may share), and the sequence's table covers them.
    `UnknownSequence` when the node has no table for it, `InvalidForward` otherwise. `lagging`:
    a table fetched cold, whose count may lag tokens the scheduler wrote without telling the
    block manager (in-block decode), so the tail may lie beyond it within the table."""
    if table is None:
        raise UnknownSequence(
            f"sequence {seq_id!r} is not on this node (its table comes with the step that admitted it)"
        )
    if start != table.num_tokens and not (lagging and start > table.num_tokens):
        raise InvalidForward(
            f"sequence {seq_id!r}: writes positions {start}…{context_len - 1} but the node holds "
            f"{table.num_tokens} tokens: a step writes only at the tail of a sequence"
        )
    if -(-context_len // block_size) > len(table.block_table):
        raise InvalidForward(
            f"sequence {seq_id!r}: context_len {context_len} needs {-(-context_len // block_size)} blocks, "
            f"its table (version {table.version}) has {len(table.block_table)}"
        )
    return table


__all__ = [
    "check_tail","NodeTable", "SeqId", "StagedSteps", "TableCache", "stage"]
