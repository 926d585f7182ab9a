"""Scheduler leases: one scheduler drives a pool at a time.

The scheduler is the one sequencer of a pool's memory (steps.py), so two schedulers must never
interleave steps on one pool. The first scheduler that sends work for a pool takes its lease
(a new lease epoch); its steps renew it. Another scheduler is refused (`PoolLeased`) while the
lease holds. When the holder's lease has lapsed, the service hands the pool over cleanly: it
journals a release (the old holder's sequences are dropped: their requests died with it or were
fenced off), and the newcomer takes a new lease epoch.

Pure and deterministic like the rest of the core: holders and epochs are durable (snapshots),
deadlines are wall-clock facts of one process and restart at recovery (`renew_all`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from block_manager.core.errors import InvalidRequest, PoolLeased
from block_manager.core.types import PoolId

MAX_SCHEDULER_ID_LEN = 128


@dataclass(slots=True)
class Lease:
    scheduler_id: str
    epoch: int
    deadline: float = 0.0


def check_scheduler_id(scheduler_id: object) -> str:
    if (
        not isinstance(scheduler_id, str)
        or not 0 < len(scheduler_id) <= MAX_SCHEDULER_ID_LEN
        or not scheduler_id.isascii()
        or not scheduler_id.isprintable()
    ):
        raise InvalidRequest(f"scheduler_id must be 1..{MAX_SCHEDULER_ID_LEN} printable ASCII characters")
    return scheduler_id


class PoolLeases:
    """Holder and epoch of every pool's scheduler lease; epochs never repeat per pool."""

    def __init__(self, ttl_s: float) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0:
            raise InvalidRequest(f"scheduler lease ttl must be > 0, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self._leases: dict[PoolId, Lease] = {}
        self._last_epoch: dict[PoolId, int] = {}

    def get(self, pool_id: str) -> Lease | None:
        return self._leases.get(PoolId(pool_id))

    def holders(self) -> dict[PoolId, Lease]:
        return dict(self._leases)

    def blocked(self, pool_id: str, scheduler_id: str, now: float) -> Lease | None:
        """The other scheduler's lease that stops `scheduler_id` from driving the pool now."""
        lease = self._leases.get(PoolId(pool_id))
        if lease is None or lease.scheduler_id == scheduler_id:
            return None
        return lease

    def lapsed(self, pool_id: str, now: float) -> bool:
        lease = self._leases.get(PoolId(pool_id))
        return lease is not None and lease.deadline <= now

    def check(self, pool_id: str, scheduler_id: str, now: float) -> None:
        """`PoolLeased` when another scheduler holds the pool (lapsed or not: a lapsed lease is
        released by an explicit, journaled handover, never implicitly)."""
        other = self.blocked(pool_id, scheduler_id, now)
        if other is not None:
            left = max(0.0, other.deadline - now)
            raise PoolLeased(
                f"pool {pool_id!r} is driven by scheduler {other.scheduler_id[:64]!r} "
                f"(lease epoch {other.epoch}, {left:.1f} s left)"
            )

    def acquire(self, pool_id: str, scheduler_id: str, now: float) -> int:
        """Take or renew the lease (the caller ran `check`); its epoch."""
        pid = PoolId(pool_id)
        lease = self._leases.get(pid)
        if lease is None:
            epoch = self._last_epoch.get(pid, 0) + 1
            self._last_epoch[pid] = epoch
            lease = self._leases[pid] = Lease(scheduler_id, epoch)
        lease.deadline = now + self.ttl_s
        return lease.epoch

    def held_by(self, scheduler_id: str) -> list[PoolId]:
        """The pools `scheduler_id` holds the lease of, sorted."""
        return sorted(p for p, lease in self._leases.items() if lease.scheduler_id == scheduler_id)

    def renew_holder(self, scheduler_id: str, now: float) -> None:
        """Renew every lease `scheduler_id` holds (a fleet member's heartbeat)."""
        for lease in self._leases.values():
            if lease.scheduler_id == scheduler_id:
                lease.deadline = now + self.ttl_s

    def release(self, pool_id: str) -> Lease | None:
        return self._leases.pop(PoolId(pool_id), None)

    def renew_all(self, now: float) -> None:
        for lease in self._leases.values():
            lease.deadline = now + self.ttl_s

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "leases": [[p, lease.scheduler_id, lease.epoch] for p, lease in sorted(self._leases.items())],
            "last_epochs": sorted([p, e] for p, e in self._last_epoch.items()),
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any], ttl_s: float, now: float) -> PoolLeases:
        leases = cls(ttl_s)
        try:
            for pid, sid, epoch in data["leases"]:
                leases._leases[PoolId(pid)] = Lease(check_scheduler_id(sid), int(epoch))
            for pid, epoch in data["last_epochs"]:
                leases._last_epoch[PoolId(pid)] = int(epoch)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed scheduler lease snapshot: {exc!r}") from exc
        leases.renew_all(now)
        return leases


__all__ = ["Lease", "PoolLeased", "PoolLeases", "check_scheduler_id"]
