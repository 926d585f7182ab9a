"""Fleet membership (issue 46): several engines over one block manager, each driving only the
nodes the block manager assigns it.

An engine in the fleet is a *member*: it heartbeats the block manager (`SchedulerHeartbeat`)
every third of the membership TTL (at most every second) on its own thread, never on the step
path, with its load
(running and waiting sequences, for routers and balancing), its API address (where routers
send requests), its pins (`--nodes`) and the pools it finished handing over. Each answer is its
*assignment*: the pools it owns now (it steps on those and no others; ownership is the pool's
scheduler lease), those of them it is asked to release (the block manager rebalances), and
those whose open step holds serve grants for another member's prefix fetch (a Step of this
member delivers them to their nodes).

`FleetMember` is that thread and the latest assignment, read by the engine thread through
`view()`; the engine applies it between two runs of its nodes (`engine.fleet_pools`). Why a
thread and not the step: an engine busy with a long step, or idle, must still renew its
membership, and the heartbeat must never wait on a node. A member that stops heartbeating (its
process died or was paused past the TTL) loses its pools to the others; one that leaves
(`leave`, on shutdown, after freeing everything) hands them over at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from block_manager.client import BlockManagerClient
from block_manager.client.types import FleetAssignment, OwnedPool
from pagedkv.logging import get_logger

# Between two heartbeats: a third of the TTL, at most MAX_INTERVAL_S. The answer also says which
# owned pools hold a serve grant for another member's prefix fetch, whose node waits for it
# (`fetch_grant_wait_s`, 10 s by default): an idle engine learns of it only from a heartbeat, so
# it beats often enough for the grant to arrive well in time, whatever the TTL.
MAX_INTERVAL_S = 1.0
log = get_logger("engine.fleet")

Load = Callable[[], tuple[int, int]]   # (running, waiting) sequences now


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """How an engine joins the fleet: its API base URL for routers ("" = not routable) and the
    pools it may own (`--nodes`; empty = any the block manager assigns)."""

    address: str = ""
    pin_pool_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FleetView:
    """The latest assignment as the engine thread reads it. `lending`: the number of the last
    heartbeat whose answer named pools with serve grants waiting (0: none yet), so the engine
    sends one Step per such answer, not one per step."""

    owned: Mapping[str, OwnedPool] = field(default_factory=dict)
    release_pool_ids: frozenset[str] = frozenset()
    lending: int = 0


class FleetMember:
    """This engine's membership: the heartbeat thread, the latest assignment, and the pools it
    released that the block manager has not heard of yet."""

    def __init__(self, client: BlockManagerClient, settings: FleetSettings | None = None) -> None:
        self.client = client
        self.settings = settings or FleetSettings()
        self.ttl_s: float | None = None          # from the first answer
        self.num_heartbeats = 0                  # answered
        self._load: Load = lambda: (0, 0)
        self._view = FleetView()
        self._released: set[str] = set()         # released here, not yet in an answered heartbeat
        self._answered_at = 0.0                  # monotonic time of the last answer
        self._tried_at = 0.0
        self._lock = threading.Lock()            # the view and the released set
        self._beat_lock = threading.RLock()      # one heartbeat at a time (thread, engine, leave)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._left = False

    @property
    def scheduler_id(self) -> str:
        return self.client.scheduler_id

    # ---- the engine thread's side ---------------------------------------------------------
    def join(self) -> FleetView:
        """Join: one heartbeat on the caller's thread (its errors are the caller's, as any
        start-up failure); the first assignment."""
        if self.num_heartbeats == 0:
            self._beat(raise_errors=True)
        return self.view()

    def start(self, load: Load) -> None:
        """Heartbeat every third of the TTL from now on, with `load()` (running, waiting)."""
        self._load = load
        self.join()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-heartbeat", daemon=True)
            self._thread.start()

    def view(self) -> FleetView:
        with self._lock:
            return self._view

    def adoptable(self) -> list[OwnedPool]:
        """The owned pools the engine may drive: all but those it released (the block manager
        has not answered that heartbeat yet). What the background discovery probes."""
        with self._lock:
            return [p for pid, p in self._view.owned.items() if pid not in self._released]

    def may_drive(self, pool_id: str) -> bool:
        with self._lock:
            return pool_id in self._view.owned and pool_id not in self._released

    def released(self, pool_id: str) -> None:
        """The engine holds nothing on `pool_id` any more (it was asked to release it): said in
        the next heartbeat, and not driven again unless the block manager assigns it anew."""
        with self._lock:
            self._released.add(pool_id)

    def ensure_fresh(self) -> None:
        """On the engine thread before a step: when no heartbeat was answered for two thirds of
        the TTL (this process was paused, the thread starved), heartbeat now, so the step is
        planned on what the engine still owns, not on pools already handed to another member
        (a Step naming one is refused whole). At most one try per third of the TTL."""
        ttl = self.ttl_s
        now = time.monotonic()
        if ttl is None or self._left or now - self._answered_at < ttl * 2 / 3 or now - self._tried_at < ttl / 3:
            return
        self._beat(raise_errors=False)

    def leave(self) -> None:
        """Stop heartbeating and leave the fleet (after the engine freed everything): the block
        manager releases every pool this member owns and gives them to the others now, instead
        of after the TTL."""
        self.close()
        if self._left or self.num_heartbeats == 0:
            return
        self._left = True
        with self._beat_lock, self._lock:
            released = tuple(sorted(self._released))
        try:
            self.client.scheduler_heartbeat(address=self.settings.address, pin_pool_ids=self.settings.pin_pool_ids,
                                            released_pool_ids=released, leave=True, timeout_s=self._timeout_s())
            log.info("fleet_left", scheduler_id=self.scheduler_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the membership lapses after the TTL anyway
            log.warning("fleet_leave_failed", scheduler_id=self.scheduler_id, error=str(exc))

    def close(self) -> None:
        """Stop the heartbeat thread (the membership lapses after the TTL; `leave` ends it now)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # ---- the heartbeat ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._interval_s()):
            self._beat(raise_errors=False)

    def _interval_s(self) -> float:
        return MAX_INTERVAL_S if self.ttl_s is None else min(self.ttl_s / 3, MAX_INTERVAL_S)

    def _timeout_s(self) -> float | None:
        """A heartbeat attempt's deadline: a third of the TTL, so a slow block manager delays
        the next heartbeat but never past the membership."""
        return None if self.ttl_s is None else max(self.ttl_s / 3, 0.5)

    def _beat(self, *, raise_errors: bool) -> bool:
        """One heartbeat; whether it was answered."""
        with self._beat_lock:
            if self._left:
                return False
            self._tried_at = time.monotonic()
            with self._lock:
                released = tuple(sorted(self._released))
            try:
                num_running, num_waiting = self._load()
                answer = self.client.scheduler_heartbeat(
                    address=self.settings.address, pin_pool_ids=self.settings.pin_pool_ids,
                    num_running=num_running, num_waiting=num_waiting, released_pool_ids=released,
                    timeout_s=self._timeout_s())
            except Exception as exc:
                if raise_errors:
                    raise
                log.warning("fleet_heartbeat_failed", scheduler_id=self.scheduler_id, error=str(exc))
                return False
            self._answered(answer, released)
            return True

    def _answered(self, answer: FleetAssignment, released: tuple[str, ...]) -> None:
        self.num_heartbeats += 1
        self.ttl_s = answer.ttl_s if answer.ttl_s > 0 else self.ttl_s
        self._answered_at = time.monotonic()
        with self._lock:
            before = self._view
            owned = {p.pool_id: p for p in answer.pools}
            lending = self.num_heartbeats if answer.lending_pool_ids else before.lending
            self._view = FleetView(owned, frozenset(answer.release_pool_ids), lending)
            self._released.difference_update(released)   # the block manager has them now
        if set(owned) != set(before.owned) or self._view.release_pool_ids != before.release_pool_ids:
            log.info("fleet_assignment", scheduler_id=self.scheduler_id, pools=sorted(owned),
                     release=sorted(answer.release_pool_ids))


__all__ = ["FleetMember", "FleetSettings", "FleetView"]
