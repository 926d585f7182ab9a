"""The node's cache of block tables, keyed by sequence and version.

A table only ever moves forward (versions increase), so a cached table at least as new as the
version a request needs can be used without asking the block manager: in steady-state decode
most steps need no table RPC at all.

One event makes cached tables untrustworthy although no request asked for a newer version:
the commit of a defrag plan (triggered by this node acknowledging the plan's moves), which
rewrites tables and frees the source blocks. Every cached table is then marked *suspect*, and
the next forward that needs one re-checks it with a `GetTables` carrying `known_versions` (the
block manager returns only what changed). Everything else that changes a table — a new block,
copy-on-write, a fork child — bumps the version the scheduler then asks for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NewType

SeqId = NewType("SeqId", str)


@dataclass(slots=True, frozen=True)
class CachedTable:
    seq_id: SeqId
    block_table: tuple[int, ...]
    version: int


class TableCache:
    """LRU of block tables with per-entry 'suspect' marks (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tables: OrderedDict[SeqId, CachedTable] = OrderedDict()
        self._suspect: set[SeqId] = set()

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, seq_id: SeqId) -> CachedTable | None:
        table = self._tables.get(seq_id)
        if table is not None:
            self._tables.move_to_end(seq_id)
        return table

    def is_fresh(self, seq_id: SeqId, version: int) -> bool:
        """Usable for a request that needs `version`, without asking the block manager."""
        table = self._tables.get(seq_id)
        return table is not None and table.version >= version and seq_id not in self._suspect

    def known_version(self, seq_id: SeqId) -> int | None:
        table = self._tables.get(seq_id)
        return None if table is None else table.version

    def put(self, table: CachedTable) -> None:
        """Store a table from the block manager (never replacing a newer one)."""
        old = self._tables.get(table.seq_id)
        if old is None or table.version >= old.version:
            self._tables[table.seq_id] = table
        self._tables.move_to_end(table.seq_id)
        while len(self._tables) > self.capacity:
            evicted, _ = self._tables.popitem(last=False)
            self._suspect.discard(evicted)

    def confirm(self, seq_id: SeqId) -> None:
        """The block manager confirmed the cached version is current."""
        self._suspect.discard(seq_id)

    def mark_all_suspect(self) -> None:
        self._suspect.update(self._tables)

    def drop(self, seq_ids: Iterable[SeqId]) -> None:
        for seq_id in seq_ids:
            self._tables.pop(seq_id, None)
            self._suspect.discard(seq_id)

    def clear(self) -> None:
        self._tables.clear()
        self._suspect.clear()
