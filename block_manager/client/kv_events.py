"""A subscriber's side of the KV events stream (docs/kv_events.md): a replica of what is
cached where, built by applying `KvEvent`s in order, and the plain-dict form the CLI prints.

`KvView.apply` follows the protocol: a `resync` drops the view and starts a snapshot (the
BlockStored entries that follow carry the snapshot's id), `snapshot_end` closes it, and every
other event is applied and becomes `last_event_id` — the id to resume from after a
disconnect (`SubscribeKvEventsRequest.from_event_id`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.v1 import block_manager_pb2 as pb

TIER_NAMES = {pb.KV_TIER_DEVICE: "device", pb.KV_TIER_HOST: "host", pb.KV_TIER_DISK: "disk",
              pb.KV_TIER_UNSPECIFIED: "all"}

# (node, tier) -> {block hash: (parent hash | None, salt id, tokens in the block)}
ViewBlocks = dict[tuple[str, str], dict[bytes, tuple[bytes | None, str, int]]]


class ProtocolViolation(Exception):
    """The stream broke its own rules (an id going backwards): drop the view, resubscribe from 0."""


@dataclass(slots=True)
class KvView:
    blocks: ViewBlocks = field(default_factory=dict)
    last_event_id: int = 0
    in_snapshot: bool = False
    num_resyncs: int = 0
    num_events: int = 0
    resync_reasons: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """Whether the view describes the server (not in the middle of a snapshot, not empty-handed)."""
        return not self.in_snapshot and self.last_event_id > 0

    def apply(self, ev: pb.KvEvent) -> None:
        kind = ev.WhichOneof("kind")
        eid = ev.event_id
        if kind == "resync":
            self.blocks.clear()
            self.in_snapshot = True
            self.num_resyncs += 1
            self.resync_reasons.append(ev.resync.reason)
            self.last_event_id = eid
            return
        if kind == "snapshot_end":
            self.in_snapshot = False
            self.last_event_id = eid
            return
        if self.in_snapshot:
            if eid != self.last_event_id:
                raise ProtocolViolation(f"snapshot entry {eid} inside the snapshot of {self.last_event_id}")
        elif eid <= self.last_event_id:
            raise ProtocolViolation(f"event {eid} after {self.last_event_id}")
        self.num_events += 1
        self.last_event_id = eid
        if kind == "block_stored":
            s = ev.block_stored
            entries = self.blocks.setdefault((s.node_id, TIER_NAMES[s.tier]), {})
            per_block = s.num_tokens // max(len(s.block_hashes), 1)
            parent = s.parent_hash or None
            for h in s.block_hashes:
                entries[h] = (parent, s.salt_id, per_block)
                parent = h
        elif kind == "block_removed":
            r = ev.block_removed
            key = (r.node_id, TIER_NAMES[r.tier])
            held = self.blocks.get(key)
            if held is not None:
                for h in r.block_hashes:
                    held.pop(h, None)
                if not held:
                    del self.blocks[key]
        elif kind == "all_blocks_cleared":
            c = ev.all_blocks_cleared
            tier = TIER_NAMES[c.tier]
            for key in [k for k in self.blocks if k[0] == c.node_id and (tier == "all" or k[1] == tier)]:
                del self.blocks[key]


def event_dict(ev: pb.KvEvent) -> dict[str, Any]:
    """One event as a flat JSON-ready dict: `kind`, `event_id`, hashes in hex."""
    kind = ev.WhichOneof("kind") or "unknown"
    d: dict[str, Any] = {"event_id": ev.event_id, "kind": kind}
    if kind == "block_stored":
        s = ev.block_stored
        d.update(node_id=s.node_id, tier=TIER_NAMES[s.tier], block_hashes=[h.hex() for h in s.block_hashes],
                 parent_hash=s.parent_hash.hex() or None, num_tokens=s.num_tokens, salt_id=s.salt_id or None)
    elif kind == "block_removed":
        r = ev.block_removed
        d.update(node_id=r.node_id, tier=TIER_NAMES[r.tier], block_hashes=[h.hex() for h in r.block_hashes])
    elif kind == "all_blocks_cleared":
        d.update(node_id=ev.all_blocks_cleared.node_id, tier=TIER_NAMES[ev.all_blocks_cleared.tier])
    elif kind == "resync":
        d.update(reason=ev.resync.reason)
    elif kind == "snapshot_end":
        d.update(num_blocks=ev.snapshot_end.num_blocks)
    return d


def event_line(ev: pb.KvEvent, hash_chars: int = 12) -> str:
    """One event as one human-readable line."""
    d = event_dict(ev)
    kind = d["kind"]
    head = f"#{d['event_id']} {kind.replace('_', '-'):<18}"
    if kind == "block_stored":
        hashes = ",".join(h[:hash_chars] for h in d["block_hashes"])
        parent = (d["parent_hash"] or "-")[:hash_chars]
        return (f"{head} node={d['node_id']} tier={d['tier']} blocks={len(d['block_hashes'])} "
                f"tokens={d['num_tokens']} salt={d['salt_id'] or '-'} parent={parent} hashes={hashes}")
    if kind == "block_removed":
        hashes = ",".join(h[:hash_chars] for h in d["block_hashes"])
        return f"{head} node={d['node_id']} tier={d['tier']} blocks={len(d['block_hashes'])} hashes={hashes}"
    if kind == "all_blocks_cleared":
        return f"{head} node={d['node_id']} tier={d['tier']}"
    if kind == "resync":
        return f"{head} reason={d['reason']!r} (a snapshot as of this id follows)"
    if kind == "snapshot_end":
        return f"{head} blocks={d['num_blocks']}"
    return head


__all__ = ["KvView", "ProtocolViolation", "TIER_NAMES", "ViewBlocks", "event_dict", "event_line"]
