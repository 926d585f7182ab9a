"""Fleet mode in the service: `SchedulerHeartbeat`, member lapse, and what Route and the admin
plane read about owners (docs/block_manager_service.md, "Fleet mode").

The decisions are the core's (`block_manager/core/fleet.py`: one round = releases, grants,
release requests); this module runs a round on each heartbeat and when a member lapses (one
timer at the earliest member deadline, like node lease expiry in `runtime.py`), and turns the
round into journaled ops through `runtime.mutate`: `release_pool` per lease to end (the same op
and request id as the lapsed-lease handover of a Step, so both paths meet in one record), then
one `grant_pools`. Both ops check at apply time what the round assumed (the holder and epoch
of a release, no lease for a grant), so a round planned before another one's ops landed can
lose a grant but never give a pool two owners.

Membership is in memory only: a restart (or a standby taking over) starts with no members, and
members find their pools again with their next heartbeat, since the leases are durable.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from block_manager.core.errors import InvalidRequest
from block_manager.core.fleet import Fleet, FleetPlan, Member, check_address
from block_manager.core.leases import check_scheduler_id
from block_manager.core.nodes import check_node_id
from block_manager.core.types import PoolId
from block_manager.service.request_index import internal_request_id
from block_manager.service.state_codec import check_count
from pagedkv.logging import get_logger
from pagedkv.rpc import Backoff, clip

if TYPE_CHECKING:
    from block_manager.service.runtime import ServiceRuntime

log = get_logger(__name__)


@dataclass(slots=True, frozen=True)
class OwnedPoolInfo:
    pool_id: str
    address: str
    lease_epoch: int


@dataclass(slots=True, frozen=True)
class Assignment:
    """A heartbeat's answer (`SchedulerHeartbeatResponse`)."""

    pools: list[OwnedPoolInfo]
    release_pool_ids: Sequence[str]
    ttl_s: float
    lending_pool_ids: Sequence[str]


def plan_ops(plan: FleetPlan) -> list[tuple[str, str, dict[str, Any]]]:
    """A round as journaled ops `(op, request id, payload)`, in order: one `release_pool` per
    lease to end (the request id the lapsed-lease handover of a Step uses too), then one
    `grant_pools`."""
    ops: list[tuple[str, str, dict[str, Any]]] = []
    for pid, holder, epoch in plan.releases:
        rid = internal_request_id("release", pid, holder, epoch)
        ops.append(("release_pool", rid, {"pool_id": pid, "scheduler_id": holder, "epoch": epoch}))
    if plan.grants:
        rid = internal_request_id("grant", uuid.uuid4().hex)
        ops.append(("grant_pools", rid, {"grants": [[p, s] for p, s in plan.grants]}))
    return ops


class FleetService:
    """The fleet's members (core `Fleet`) driven by heartbeats and a lapse timer."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.fleet = Fleet(runtime.config.scheduler_lease_ttl_s)
        self._timer: asyncio.TimerHandle | None = None
        self._backoff = Backoff(initial_s=0.05, max_s=5.0)
        self._poked = False

    # ---- lifecycle --------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every member (recovery: members heartbeat again)."""
        self.cancel()
        self.fleet = Fleet(self.runtime.config.scheduler_lease_ttl_s)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def is_member(self, scheduler_id: object) -> bool:
        return isinstance(scheduler_id, str) and self.fleet.is_member(scheduler_id)

    def owner(self, pool_id: str) -> Member | None:
        """The live member holding the pool's lease (None: no member owns it)."""
        lease = self.runtime.state.leases.get(pool_id)
        return None if lease is None else self.fleet.get(lease.scheduler_id)

    # ---- the RPC ----------------------------------------------------------------------
    async def heartbeat(
        self, scheduler_id: str, *, address: str = "", pin_pool_ids: Sequence[str] = (), num_running: int = 0,
        num_waiting: int = 0, released_pool_ids: Sequence[str] = (), leave: bool = False,
    ) -> Assignment:
        """Join / renew (or leave), then one round; the pools the scheduler owns after it."""
        rt = self.runtime
        rt.check_writable()
        sid = check_scheduler_id(scheduler_id)
        check_address(address)
        max_batch = rt.state.config.max_batch
        for name, ids in (("pin_pool_ids", pin_pool_ids), ("released_pool_ids", released_pool_ids)):
            check_count(f"number of {name}", len(ids), 0, max_batch)
            for pool_id in ids:
                check_node_id(pool_id)   # pool ids are node ids
            if len(set(ids)) != len(ids):
                raise InvalidRequest(f"duplicate {name}")
        for name, n in (("num_running", num_running), ("num_waiting", num_waiting)):
            check_count(name, n, 0, 1 << 32)
        now = rt.clock()
        views = rt.state.fleet_views(now)
        self.fleet.forget_requests(views)
        if leave:
            plan = self.fleet.plan(views, leaving={sid})
            self.fleet.remove(sid)
            log.info("fleet member left", scheduler=sid[:64], releases=len(plan.releases))
        else:
            joined = not self.fleet.is_member(sid)
            self.fleet.heartbeat(sid, now, address=address, pin_pool_ids=pin_pool_ids, num_running=num_running,
                                 num_waiting=num_waiting)
            rt.state.leases.renew_holder(sid, now)
            if joined:
                log.info("fleet member joined", scheduler=sid[:64], address=clip(address, 128))
            plan = self.fleet.plan(views, released={sid: set(released_pool_ids)})
            self.fleet.released(sid, released_pool_ids)
        await self._apply(plan)
        # the answer may describe another round's grants or releases still being committed:
        # it leaves once they are durable (the runtime's rule for answers that change nothing)
        await rt.writer.barrier()
        self.arm()
        return self.assignment(sid)

    def assignment(self, scheduler_id: str) -> Assignment:
        state = self.runtime.state
        held = [pid for pid in state.leases.held_by(scheduler_id) if pid in state.core.pool_ids]
        pools = []
        for pid in held:
            lease = state.leases.get(pid)
            pools.append(OwnedPoolInfo(pid, state.registry.get(pid).address, 0 if lease is None else lease.epoch))
        member = self.fleet.get(scheduler_id)
        asked = sorted(set(held) & member.release_pool_ids) if member is not None else []
        lending = [pid for pid in held if state.core.is_lending(PoolId(pid))]
        return Assignment(pools, asked, self.fleet.ttl_s, lending)

    # ---- rounds -----------------------------------------------------------------------
    async def _apply(self, plan: FleetPlan) -> None:
        """Journal a round: releases first (each checked against the holder and epoch it ends),
        then the grants (each only onto a pool without a lease), then record the asks."""
        rt = self.runtime
        for op, rid, body in plan_ops(plan):
            result = await rt.mutate(op, rid, rid, body, internal=True)
            if op == "release_pool":
                log.warning("fleet: pool released", pool=body["pool_id"], scheduler=body["scheduler_id"][:64],
                            lease_epoch=body["epoch"], released=result["released"],
                            dropped=len(result["dropped_seq_ids"]))
            for pid, sid, epoch in result.get("granted", ()):
                log.info("fleet: pool granted", pool=pid, scheduler=sid[:64], lease_epoch=epoch)
        self.fleet.ask(plan.asks)
        for sid, pid in plan.asks:
            log.info("fleet: release requested", pool=pid, scheduler=sid[:64])

    def arm(self) -> None:
        """One timer at the earliest member deadline (re-armed after each round)."""
        self.cancel()
        if self.runtime.phase not in ("serving", "draining"):
            return
        deadline = self.fleet.next_deadline()
        if deadline is None:
            return
        delay = max(0.0, deadline - self.runtime.clock()) + 0.001
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        rt = self.runtime
        now = rt.clock()
        expired = self.fleet.expired(now)
        if not expired:
            self.arm()
            return
        views = rt.state.fleet_views(now)
        self.fleet.forget_requests(views)
        plan = self.fleet.plan(views, leaving=set(expired))
        for sid in expired:
            self.fleet.remove(sid)
            log.warning("fleet member lapsed; its pools go to the others", scheduler=sid[:64])
        rt.tasks.spawn(self._lapse(plan), name="fleet-lapse")

    async def _lapse(self, plan: FleetPlan) -> None:
        try:
            await self._apply(plan)
        except Exception as exc:  # noqa: BLE001 - logged; the next round (heartbeat or timer) redoes it
            log.error("fleet round failed", error=clip(repr(exc)))
            if self.runtime.phase in ("serving", "draining"):
                self._timer = asyncio.get_running_loop().call_later(self._backoff.next_delay(), self._retry)
            return
        self._backoff.reset()
        self.arm()

    def poke(self) -> None:
        """A round soon (a node registered: its pool has no lease and members would wait for
        their next heartbeat to get it). Nothing without members."""
        if not self.fleet.members() or self.runtime.phase not in ("serving", "draining") or self._poked:
            return
        self._poked = True
        self.runtime.tasks.spawn(self._poke_round(), name="fleet-round")

    async def _poke_round(self) -> None:
        self._poked = False
        rt = self.runtime
        try:
            await self._apply(self.fleet.plan(rt.state.fleet_views(rt.clock())))
        except Exception as exc:  # noqa: BLE001 - logged; the next heartbeat redoes the round
            log.error("fleet round failed", error=clip(repr(exc)))

    def _retry(self) -> None:
        """After a failed lapse round: a round with no member leaving (lapsed leases of
        non-members, which the departed members' now are, are released and reassigned)."""
        self._timer = None
        rt = self.runtime
        views = rt.state.fleet_views(rt.clock())
        plan = self.fleet.plan(views, leaving=set())
        rt.tasks.spawn(self._lapse(plan), name="fleet-retry")

    # ---- reads ------------------------------------------------------------------------
    def members(self) -> list[dict[str, Any]]:
        """Every member as `ListSchedulers` answers it."""
        now = self.runtime.clock()
        out = []
        for m in self.fleet.members():
            a = self.assignment(m.scheduler_id)
            out.append({
                "scheduler_id": m.scheduler_id, "address": m.address, "pool_ids": [p.pool_id for p in a.pools],
                "release_pool_ids": a.release_pool_ids, "pin_pool_ids": sorted(m.pin_pool_ids),
                "num_running": m.num_running, "num_waiting": m.num_waiting,
                "remaining_s": m.deadline - now,
            })
        return out


__all__ = ["Assignment", "FleetService", "OwnedPoolInfo", "plan_ops"]
