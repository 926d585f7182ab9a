"""The engine thread's side of fleet membership (`engine.fleet`): the latest assignment applied
to the nodes the engine drives, between two runs of its nodes.

- A pool newly owned is adopted like a node found late (`engine.discovery` probes it off the
  step path, `LLMEngine` adopts it between steps); its lease epoch is noted.
- A pool the block manager asks back (`release_pool_ids`: it rebalances) takes no admission
  from then on, its sequences are freed and re-queued by recompute for the engine's other nodes
  (the failure table's HELD / PoolReleasing row; tokens already streamed stay, as after any
  preemption), and once nothing of it is left here (its frees sent, its last step reported, no
  unanswered Step) the engine stops driving it and the next heartbeat says it is released. Only
  then does the block manager give it to another member: no pool ever has two drivers.
- A pool that vanishes from the assignment, or comes back under another lease epoch, went to
  another member meanwhile (this engine missed heartbeats for a TTL): the handover dropped the
  engine's sequences there, so they are re-queued with nothing to free (HELD / PoolLost), and
  the node is no longer driven (or, same pool again, driven afresh).

A member that owns no node for a TTL (its nodes died or went to others, and none came back)
refuses new requests and fails the ones it queued (`NoNodeOwned`: 503, the router retries them on
another engine) rather than hold them until a node comes back.

Dropping and releasing need the nodes idle (nothing of the pool in flight), so `LLMEngine` drains
the step in flight first when `needs_idle_nodes` says so; adoption does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from block_manager.client import BlockManagerClient
from engine.bm_steps import StepSender
from engine.errors import PoolLost, PoolReleasing
from engine.failure_policy import Item
from engine.fleet import FleetMember, FleetView
from engine.health import NodeHealth
from engine.scheduler import Scheduler
from engine.step_plan import NodeView
from pagedkv.logging import get_logger

FIRST_TTL_S = 30.0    # the block manager's default membership TTL, until the first answer says it
log = get_logger("engine.fleet_pools")


@dataclass(slots=True)
class FleetPools:
    member: FleetMember
    view: NodeView
    scheduler: Scheduler
    health: NodeHealth
    client: BlockManagerClient
    sender: StepSender
    epochs: dict[str, int] = field(default_factory=dict)          # driven pool -> its lease epoch when adopted
    releasing: dict[str, set[str]] = field(default_factory=dict)  # pool -> ids whose frees must go out first
    lending_sent: int = 0                                         # the last `FleetView.lending` a Step answered
    num_released: int = 0
    num_lost: int = 0
    nodeless_since: float | None = None                           # monotonic time it last owned no node from
    NO_NODE: ClassVar[str] = ("this engine owns no model node now (fleet mode: its nodes went to other engines or "
                              "away); retry on another engine")

    def adopted(self, pool_id: str) -> None:
        """`pool_id` is driven from now on (at start, or found by the discovery)."""
        owned = self.member.view().owned.get(pool_id)
        if owned is not None:
            self.epochs[pool_id] = owned.lease_epoch

    def needs_idle_nodes(self) -> bool:
        """Whether `apply` has a pool to drop or release (the step in flight must end first)."""
        fleet = self.member.view()
        return bool(self._lost(fleet)) or any(p in self.view.nodes for p in fleet.release_pool_ids)

    def lending_due(self) -> int:
        """The assignment whose serve grants no Step has delivered yet (0: none)."""
        lending = self.member.view().lending
        return lending if lending > self.lending_sent else 0

    def apply(self) -> None:
        """Drop the pools lost, release those asked back (nothing of them in flight)."""
        fleet = self.member.view()
        for pool_id in self._lost(fleet):
            self.num_lost += 1
            self._requeue(pool_id, PoolLost(pool_id))
            owned = fleet.owned.get(pool_id)
            if owned is not None and owned.lease_epoch != self.epochs.get(pool_id):
                log.warning("fleet_pool_handed_back", pool_id=pool_id, lease_epoch=owned.lease_epoch)
                self.epochs[pool_id] = owned.lease_epoch   # the same node, driven afresh
            else:
                log.warning("fleet_pool_lost", pool_id=pool_id)
                self._stop_driving(pool_id)
        for pool_id in sorted(fleet.release_pool_ids & self.view.nodes.keys()):
            if pool_id not in self.releasing:
                log.info("fleet_pool_releasing", pool_id=pool_id)
                pending = set(self.scheduler.queues.to_free)   # a finished sequence of it among them, maybe
                self.releasing[pool_id] = pending | self._requeue(pool_id, PoolReleasing(pool_id))
            if self._quiet(pool_id):
                self._stop_driving(pool_id)
                self.member.released(pool_id)
                self.num_released += 1
                log.info("fleet_pool_released", pool_id=pool_id)
        self.view.releasing = frozenset(self.releasing)
        if self.gave_up():
            for seq in list(self.scheduler.queues.waiting):
                seq.request.unavailable = True
                self.scheduler.fail_request(seq.request, self.NO_NODE)

    def gave_up(self) -> bool:
        """Whether the engine owns no node, and has owned none for a membership TTL (long enough
        for a handover or an adoption under way): its requests are better served elsewhere."""
        now = time.monotonic()
        if self.view.nodes:
            self.nodeless_since = None
            return False
        if self.nodeless_since is None:
            self.nodeless_since = now
        return now - self.nodeless_since >= (self.member.ttl_s or FIRST_TTL_S)

    def _lost(self, fleet: FleetView) -> list[str]:
        """Driven pools the assignment no longer gives this engine, or gives under a new lease."""
        lost = []
        for pool_id in self.view.nodes:
            owned = fleet.owned.get(pool_id)
            if owned is None or owned.lease_epoch != self.epochs.get(pool_id, owned.lease_epoch):
                lost.append(pool_id)
        return lost

    def _requeue(self, pool_id: str, error: PoolLost | PoolReleasing) -> set[str]:
        """Every sequence held on `pool_id` (running or swapped) goes by the failure table's
        HELD row for `error`; the ids they held."""
        queues = self.scheduler.queues
        held = [s for s in (*queues.running, *queues.swapped) if s.node_id == pool_id]
        ids = {s.admitted.seq_id for s in held}
        for seq in held:
            self.scheduler.refuse(Item.HELD, error, seq)
        if isinstance(error, PoolLost):
            for seq_id in ids:
                self.client.tracker.forget(seq_id)
        return ids

    def _quiet(self, pool_id: str) -> bool:
        """Nothing of `pool_id` is left here: no sequence on it, its frees sent and answered,
        its last step reported."""
        queues = self.scheduler.queues
        if any(s.node_id == pool_id for s in (*queues.running, *queues.swapped)):
            return False
        if self.releasing[pool_id] & set(queues.to_free) or self.sender.unanswered is not None:
            return False
        return pool_id not in self.client.pending_reports

    def _stop_driving(self, pool_id: str) -> None:
        view = self.view
        node = view.nodes.pop(pool_id, None)
        if node is not None:
            node.close()
        view.pool_blocks.pop(pool_id, None)
        view.pool_free.pop(pool_id, None)
        view.host_pools.discard(pool_id)
        view.down = view.down - {pool_id}
        self.health.forget(pool_id)
        self.epochs.pop(pool_id, None)
        self.releasing.pop(pool_id, None)


__all__ = ["FleetPools"]
