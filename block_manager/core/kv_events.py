"""Changes of the prefix indexes, as the source of the KV events stream.

A pool's device tier (`Pool`), its host tier (`HostTier`) and its disk tier (`DiskTier`) each
own a prefix index (block hash -> block or slot). Every change of one of them goes through a
handful of methods — `register` / `drop_hash` / `reset_prefix_cache` on the device side,
`offload` / disk staging (allocation.py) / `drop_hash` on the host side, `spill` / `seed` /
`drop_hash` on the disk side, `remove_pool` for a whole node — and each of those tells the tier's
`KvChangeLog`, when it has one, in O(1): one tuple appended to a list. Nothing else happens on
the hot path; the service turns the list into numbered events once the op's journal record is
committed (`block_manager/service/kv_events.py`).

Changes say *what* is cached *where* (node, tier, block hash and its identity), never which
block id holds it: a defrag move keeps the hash in the tier and is not a change. Replaying
them from an empty view in order reproduces `index_view()` of the manager exactly; that is
the contract the service's tests check after every op of a randomized workload.

Recording is off by default (an embedded core, a journal replay or a standby's copy pay
nothing); `BlockManager.record_kv_changes()` turns it on for every pool, present and future.
"""

from __future__ import annotations

from typing import Any, Literal

from block_manager.core.hashing import BlockHash
from block_manager.core.types import PoolId

KvTier = Literal["device", "host", "disk"]
KV_TIERS: tuple[KvTier, ...] = ("device", "host", "disk")

# A change is a plain tuple (built on the append hot path); its first item is its kind:
#   (STORED, pool_id, tier, block_hash, parent_hash | None, salt | None, num_tokens, token_ids)
#       token_ids: the block's own tuple (a reference, not a copy), for the vLLM-format
#       publisher, whose BlockStored carries them (service/kv_events_zmq.py)
#   (REMOVED, pool_id, tier, block_hash)
#   (CLEARED, pool_id, tier | None)        None: every tier of the node (its pool is gone)
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
KvChange = tuple

# What a tier's index holds per hash, as events describe it: (parent hash, salt, tokens).
BlockInfo = (tuple[BlockHash | None, str | None, int]
             | tuple[BlockHash | None, str | None, int, tuple[int, ...]])   # with_tokens: + the tokens
IndexView = dict[tuple[PoolId, KvTier], dict[BlockHash, BlockInfo]]


class KvChangeLog:
    """Where one tier of one pool reports its prefix-index changes (a shared list)."""

    __slots__ = ("pool_id", "tier", "out")

    def __init__(self, pool_id: PoolId, tier: KvTier, out: list[KvChange]) -> None:
        self.pool_id = pool_id
        self.tier = tier
        self.out = out

    def stored(self, meta: Any) -> None:
        """`meta` (a `BlockMeta`) became findable by its hash in this tier."""
        tokens = meta.token_ids
        self.out.append((STORED, self.pool_id, self.tier, meta.block_hash, meta.parent_hash, meta.salt,
                         len(tokens), tokens))

    def removed(self, block_hash: BlockHash) -> None:
        self.out.append((REMOVED, self.pool_id, self.tier, block_hash))

    def cleared(self) -> None:
        """Every hash of this tier was forgotten at once."""
        self.out.append((CLEARED, self.pool_id, self.tier))


def attach(pool: Any, out: list[KvChange] | None) -> None:
    """Give `pool` (and its host and disk tiers) change logs writing into `out`; None detaches."""
    pool.kv_log = None if out is None else KvChangeLog(pool.pool_id, "device", out)
    if pool.host is not None:
        pool.host.kv_log = None if out is None else KvChangeLog(pool.pool_id, "host", out)
        if pool.host.disk is not None:
            pool.host.disk.kv_log = None if out is None else KvChangeLog(pool.pool_id, "disk", out)


class KvRecorder:
    """The manager's switch for recording: off (None) until `record`, then one shared list
    every tier's `KvChangeLog` writes into, handed over by `take`."""

    __slots__ = ("changes",)

    def __init__(self) -> None:
        self.changes: list[KvChange] | None = None

    def record(self, pools: dict[PoolId, Any]) -> None:
        if self.changes is None:
            self.changes = []
            for pool in pools.values():
                attach(pool, self.changes)

    def take(self) -> list[KvChange]:
        out = self.changes
        if not out:
            return []
        changes = list(out)
        out.clear()
        return changes

    def pool_removed(self, pool_id: PoolId) -> None:
        if self.changes is not None:
            self.changes.append((CLEARED, pool_id, None))


def index_view(pools: dict[PoolId, Any], with_tokens: bool = False) -> IndexView:
    """What every tier of every pool has in its prefix index now, keyed like the events.
    `with_tokens`: each entry also carries the block's token ids (a fourth item), for a
    publisher that starts from this view and must describe blocks by their tokens."""
    view: IndexView = {}
    for pool_id, pool in pools.items():
        tiers: list[tuple[KvTier, Any]] = [("device", pool)]
        if pool.host is not None:
            tiers.append(("host", pool.host))
            if pool.host.disk is not None:
                tiers.append(("disk", pool.host.disk))
        for tier, t in tiers:
            entries: dict[BlockHash, BlockInfo] = {}
            for h, b in t.prefix_index.items():
                m = t.meta[b]
                entries[h] = ((m.parent_hash, m.salt, len(m.token_ids), m.token_ids) if with_tokens
                              else (m.parent_hash, m.salt, len(m.token_ids)))
            if entries:
                view[(pool_id, tier)] = entries
    return view


def apply_change(view: IndexView, change: KvChange) -> None:
    """Replay one change onto a view (what a subscriber does with the events)."""
    kind, pool_id = change[0], change[1]
    if kind == STORED:
        tier, h, parent, salt, n = change[2:7]
        view.setdefault((pool_id, tier), {})[h] = (parent, salt, n)
    elif kind == REMOVED:
        entries = view.get((pool_id, change[2]))
        if entries is not None:
            entries.pop(change[3], None)
            if not entries:
                del view[(pool_id, change[2])]
    else:
        tier = change[2]
        for key in [k for k in view if k[0] == pool_id and (tier is None or k[1] == tier)]:
            del view[key]


__all__ = [
    "CLEARED", "KV_TIERS", "REMOVED", "STORED", "BlockInfo", "IndexView", "KvChange", "KvChangeLog", "KvTier",
    "KvRecorder", "apply_change", "attach", "index_view",
]
