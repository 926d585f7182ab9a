"""Compute-node registry: epochs, leases and fencing, with time passed in explicitly.

A node's pool is only trustworthy while its lease holds. Each registration of a node id
starts a new epoch; requests that carry an older epoch come from a process that has since
been replaced (or partitioned away) and are refused, so a zombie can never act on blocks
that now belong to its successor. A lease that is not renewed in time fences the node
until it registers again.

Like the rest of `core/`, this is pure and deterministic: no clock is read here. Lease
deadlines are *not* part of the snapshot: they are wall-clock facts of one block manager
process, so after a recovery every live node gets a fresh lease (`from_snapshot(d, now)`),
which gives nodes a full TTL to reconnect to the restarted manager.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest, NodeFenced, StaleEpoch, UnknownPool
from .types import PoolId

NODE_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(slots=True)
class NodeRecord:
    """What the registry knows of one node id (its latest registration)."""

    node_id: PoolId
    epoch: int
    num_blocks: int
    block_size: int
    geometry: dict[str, Any] = field(default_factory=dict)
    address: str = ""
    draining: bool = False
    fenced: bool = False
    lease_deadline: float = 0.0

    @property
    def active(self) -> bool:
        return not self.fenced


@dataclass(slots=True, frozen=True)
class NodeLease:
    """The answer to a registration or heartbeat."""

    node_id: PoolId
    epoch: int
    lease_ttl_s: float
    lease_deadline: float


def check_node_id(node_id: object) -> PoolId:
    if not isinstance(node_id, str) or NODE_ID_RE.fullmatch(node_id) is None:
        raise InvalidRequest(f"node id must match {NODE_ID_RE.pattern}, got {node_id!r}")
    return PoolId(node_id)


class NodeRegistry:
    """Epochs and leases of every node id ever registered (fenced ones included, so a
    late request from a fenced epoch gets a precise `NodeFenced` instead of "unknown")."""

    def __init__(self, lease_ttl_s: float) -> None:
        if not isinstance(lease_ttl_s, (int, float)) or isinstance(lease_ttl_s, bool) or lease_ttl_s <= 0:
            raise InvalidRequest(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        self.lease_ttl_s = float(lease_ttl_s)
        self._nodes: dict[PoolId, NodeRecord] = {}

    # ---- lookups --------------------------------------------------------------------
    def get(self, node_id: str) -> NodeRecord:
        node = self._nodes.get(PoolId(node_id))
        if node is None:
            raise UnknownPool(f"unknown node {node_id!r}")
        return node

    def nodes(self) -> list[NodeRecord]:
        return sorted(self._nodes.values(), key=lambda n: n.node_id)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    @property
    def num_active(self) -> int:
        return sum(1 for n in self._nodes.values() if n.active)

    # ---- epochs ---------------------------------------------------------------------
    def next_epoch(self, node_id: str) -> int:
        node = self._nodes.get(PoolId(node_id))
        return 1 if node is None else node.epoch + 1

    def check_epoch(self, node_id: str, epoch: int) -> NodeRecord:
        """The node's record if `epoch` is its current, unfenced epoch.

        UnknownPool for a node never registered, StaleEpoch for any other epoch (older:
        a replaced process; newer: a confused caller), NodeFenced when the current epoch's
        lease expired.
        """
        node = self.get(node_id)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise InvalidRequest(f"epoch must be an integer >= 1, got {epoch!r}")
        if epoch != node.epoch:
            raise StaleEpoch(f"node {node_id!r}: epoch {epoch} is not the current epoch {node.epoch}")
        if node.fenced:
            raise NodeFenced(f"node {node_id!r} epoch {epoch} is fenced (lease expired); register again")
        return node

    def check_active(self, node_id: str) -> NodeRecord:
        """The node's record if it is registered and not fenced (no epoch given)."""
        node = self.get(node_id)
        if node.fenced:
            raise NodeFenced(f"node {node_id!r} is fenced (lease expired); it must register again")
        return node

    # ---- mutations ------------------------------------------------------------------
    def register(
        self,
        node_id: str,
        num_blocks: int,
        block_size: int,
        geometry: dict[str, Any] | None,
        address: str,
        now: float,
    ) -> NodeLease:
        """Record a new epoch for the node (its previous epoch, if any, is superseded)."""
        nid = check_node_id(node_id)
        epoch = self.next_epoch(nid)
        self._nodes[nid] = NodeRecord(
            node_id=nid,
            epoch=epoch,
            num_blocks=num_blocks,
            block_size=block_size,
            geometry=dict(geometry or {}),
            address=address,
            lease_deadline=now + self.lease_ttl_s,
        )
        return NodeLease(nid, epoch, self.lease_ttl_s, now + self.lease_ttl_s)

    def heartbeat(self, node_id: str, epoch: int, now: float) -> NodeLease:
        """Renew the lease; NodeFenced if it already lapsed (even before the expiry is
        processed: a node that missed its deadline must not be revived by a late beat)."""
        node = self.check_epoch(node_id, epoch)
        if node.lease_deadline <= now:
            raise NodeFenced(f"node {node_id!r} epoch {epoch}: lease expired; register again")
        node.lease_deadline = now + self.lease_ttl_s
        return NodeLease(node.node_id, node.epoch, self.lease_ttl_s, node.lease_deadline)

    def set_draining(self, node_id: str, draining: bool) -> None:
        self.check_active(node_id).draining = bool(draining)

    def expired(self, now: float) -> list[NodeRecord]:
        """Active nodes whose lease deadline has passed (not yet fenced), by id."""
        return sorted(
            (n for n in self._nodes.values() if n.active and n.lease_deadline <= now),
            key=lambda n: n.node_id,
        )

    def fence(self, node_id: str, epoch: int) -> bool:
        """Fence `(node_id, epoch)`; False (no change) if that epoch is not current and
        active, which makes a replayed or duplicated expiry harmless."""
        node = self._nodes.get(PoolId(node_id))
        if node is None or node.epoch != epoch or node.fenced:
            return False
        node.fenced = True
        node.draining = False
        return True

    def expire(self, now: float) -> list[PoolId]:
        """Fence every node whose lease expired; returns their ids."""
        fenced = [n.node_id for n in self.expired(now)]
        for nid in fenced:
            self._nodes[nid].fenced = True
        return fenced

    def next_deadline(self) -> float | None:
        """Earliest lease deadline of an active node (when the next expiry check is due)."""
        deadlines = [n.lease_deadline for n in self._nodes.values() if n.active]
        return min(deadlines) if deadlines else None

    def renew_all(self, now: float) -> None:
        for node in self._nodes.values():
            if node.active:
                node.lease_deadline = now + self.lease_ttl_s

    # ---- snapshots ------------------------------------------------------------------
    def to_snapshot(self) -> dict[str, Any]:
        return {
            "lease_ttl_s": self.lease_ttl_s,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "epoch": n.epoch,
                    "num_blocks": n.num_blocks,
                    "block_size": n.block_size,
                    "geometry": n.geometry,
                    "address": n.address,
                    "draining": n.draining,
                    "fenced": n.fenced,
                }
                for n in self.nodes()
            ],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any], now: float, lease_ttl_s: float | None = None) -> NodeRegistry:
        """Rebuild from `to_snapshot()`; every active node gets a fresh lease from `now`.

        `lease_ttl_s` overrides the recorded TTL (a restart may change the config).
        """
        try:
            registry = cls(lease_ttl_s if lease_ttl_s is not None else data["lease_ttl_s"])
            for raw in data["nodes"]:
                nid = check_node_id(raw["node_id"])
                registry._nodes[nid] = NodeRecord(
                    node_id=nid,
                    epoch=int(raw["epoch"]),
                    num_blocks=int(raw["num_blocks"]),
                    block_size=int(raw["block_size"]),
                    geometry=dict(raw["geometry"]),
                    address=str(raw["address"]),
                    draining=bool(raw["draining"]),
                    fenced=bool(raw["fenced"]),
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed node registry snapshot: {exc!r}") from exc
        registry.renew_all(now)
        return registry


__all__ = ["NodeLease", "NodeRecord", "NodeRegistry", "check_node_id", "NODE_ID_RE"]
