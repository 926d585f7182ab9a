"""Fleet mode: several schedulers (engines) over one block manager, each pool owned by exactly
one live member.

Ownership IS the pool's scheduler lease (`leases.py`): this module never holds a second copy of
it. It holds what is not durable — the members (a scheduler that heartbeats: its address, load,
pins and deadline) and the release requests it made — and decides, from a view of the pools and
their lease holders, what one round changes:

- releases: leases to end now (journaled `release_pool`, which drops what the holder left
  there): the pools of members that lapsed or left, the pools a member reports released, and
  lapsed leases of schedulers that are not members (a scheduler gone before a restart, or one
  that never joined) where a member could take the pool;
- grants: every assignable pool (registered, not fenced, not draining) without a lease goes to
  the eligible member (pins respected) owning the fewest pools, then the fewest blocks, then the
  smallest id (journaled `grant_pools`);
- asks: balance. A member owning at least two pools more than another member that could own
  one of them is asked to release one (at most one request pending per member); the pool moves
  only once the member reports it released, never while it may still run sequences there.

Members are not journaled, like node heartbeats: after a restart they heartbeat again and find
their leases (durable) where they left them. A pool therefore never has two owners: a grant only
takes a pool without a lease, and a lease ends only by a journaled release.

Pure and deterministic: the caller passes `now` and a view of the pools (`PoolView`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from block_manager.core.errors import InvalidRequest
from block_manager.core.leases import check_scheduler_id

MAX_ADDRESS_LEN = 256


@dataclass(slots=True)
class Member:
    """A live fleet member as of its last heartbeat."""

    scheduler_id: str
    deadline: float
    address: str = ""
    pin_pool_ids: frozenset[str] = frozenset()
    num_running: int = 0
    num_waiting: int = 0
    release_pool_ids: set[str] = field(default_factory=set)   # asked to release, not reported yet

    def can_own(self, pool_id: str) -> bool:
        return not self.pin_pool_ids or pool_id in self.pin_pool_ids


@dataclass(slots=True, frozen=True)
class PoolView:
    """One registered pool as a round sees it."""

    pool_id: str
    num_blocks: int
    assignable: bool              # live: registered, not fenced, not draining
    holder: str | None = None     # its lease holder
    lease_epoch: int = 0
    lease_lapsed: bool = False


@dataclass(slots=True)
class FleetPlan:
    """What one round changes: leases to release (pool, holder, lease epoch), then pools to grant
    (pool, member), then release requests to make (member, pool)."""

    releases: list[tuple[str, str, int]] = field(default_factory=list)
    grants: list[tuple[str, str]] = field(default_factory=list)
    asks: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.releases or self.grants or self.asks)


def check_address(address: object) -> str:
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_LEN or not address.isprintable():
        raise InvalidRequest(f"address must be at most {MAX_ADDRESS_LEN} printable characters")
    return address


class Fleet:
    """The live members and the rounds that assign pools to them."""

    def __init__(self, ttl_s: float) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0:
            raise InvalidRequest(f"scheduler membership ttl must be > 0, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self._members: dict[str, Member] = {}

    # ---- membership -------------------------------------------------------------------
    def heartbeat(
        self, scheduler_id: str, now: float, *, address: str = "", pin_pool_ids: Iterable[str] = (),
        num_running: int = 0, num_waiting: int = 0,
    ) -> Member:
        """Join, or renew and update the member's address, pins and load."""
        sid = check_scheduler_id(scheduler_id)
        address = check_address(address)   # checked before anything changes
        member = self._members.get(sid)
        if member is None:
            member = self._members[sid] = Member(sid, now + self.ttl_s)
        member.deadline = now + self.ttl_s
        member.address = address
        member.pin_pool_ids = frozenset(pin_pool_ids)
        member.num_running, member.num_waiting = int(num_running), int(num_waiting)
        return member

    def get(self, scheduler_id: str) -> Member | None:
        return self._members.get(scheduler_id)

    def is_member(self, scheduler_id: str) -> bool:
        return scheduler_id in self._members

    def members(self) -> list[Member]:
        return [self._members[sid] for sid in sorted(self._members)]

    def remove(self, scheduler_id: str) -> Member | None:
        return self._members.pop(scheduler_id, None)

    def expired(self, now: float) -> list[str]:
        return sorted(sid for sid, m in self._members.items() if m.deadline <= now)

    def next_deadline(self) -> float | None:
        return min((m.deadline for m in self._members.values()), default=None)

    def remaining_s(self, scheduler_id: str, now: float) -> float:
        member = self._members.get(scheduler_id)
        return 0.0 if member is None else member.deadline - now

    def ask(self, asks: Iterable[tuple[str, str]]) -> None:
        """Record release requests a round decided (`FleetPlan.asks`)."""
        for sid, pool_id in asks:
            member = self._members.get(sid)
            if member is not None:
                member.release_pool_ids.add(pool_id)

    def forget_requests(self, pools: Sequence[PoolView]) -> None:
        """Drop release requests that no longer stand: for pools the member no longer holds
        (released, handed over, gone), and for pools no other member could take (the member it
        was meant for left) unless outside the holder's pins."""
        held = {(p.holder, p.pool_id) for p in pools if p.holder is not None}
        for member in self._members.values():
            sid = member.scheduler_id
            member.release_pool_ids = {
                p for p in member.release_pool_ids
                if (sid, p) in held and (not member.can_own(p) or any(
                    m.can_own(p) for m in self._members.values() if m.scheduler_id != sid))
            }

    def released(self, scheduler_id: str, pool_ids: Iterable[str]) -> None:
        """The member reported these pools released: their requests are answered (a pool that
        comes back to it later is not asked for again by the old request)."""
        member = self._members.get(scheduler_id)
        if member is not None:
            member.release_pool_ids.difference_update(pool_ids)

    # ---- one round -----------------------------------------------------------------------
    def plan(
        self, pools: Sequence[PoolView], *, leaving: Collection[str] = (),
        released: Mapping[str, Collection[str]] | None = None,
    ) -> FleetPlan:
        """The round after `leaving` members left (lapsed or said goodbye: all their pools are
        released; they are not members for the grants) and members reported `released` pools
        (those they hold are released). Nothing here changes; `ask` records the plan's asks."""
        out = FleetPlan()
        released = released or {}
        members = [m for m in self.members() if m.scheduler_id not in leaving]
        holder: dict[str, str | None] = {}
        just_released: dict[str, set[str]] = {}
        for p in sorted(pools, key=lambda p: p.pool_id):
            h = p.holder
            if h is not None and (
                h in leaving
                or p.pool_id in released.get(h, ())
                or (p.lease_lapsed and not self.is_member(h) and p.assignable
                    and any(m.can_own(p.pool_id) for m in members))
            ):
                out.releases.append((p.pool_id, h, p.lease_epoch))
                just_released.setdefault(h, set()).add(p.pool_id)
                h = None
            holder[p.pool_id] = h
        by_id = {p.pool_id: p for p in pools}
        count = {m.scheduler_id: 0 for m in members}
        blocks = {m.scheduler_id: 0 for m in members}
        for pid, h in holder.items():
            if h in count:
                count[h] += 1
                blocks[h] += by_id[pid].num_blocks
        for pid in sorted(holder):
            p = by_id[pid]
            if holder[pid] is not None or not p.assignable:
                continue
            eligible = [m for m in members if m.can_own(pid)]
            # a member does not get back at once the pool it just released, unless only it can own it
            others = [m for m in eligible if pid not in just_released.get(m.scheduler_id, ())]
            eligible = others or eligible
            if not eligible:
                continue
            best = min(eligible, key=lambda m: (count[m.scheduler_id], blocks[m.scheduler_id], m.scheduler_id))
            out.grants.append((pid, best.scheduler_id))
            holder[pid] = best.scheduler_id
            count[best.scheduler_id] += 1
            blocks[best.scheduler_id] += p.num_blocks
        out.asks = self._balance(members, holder, by_id, count)
        return out

    @staticmethod
    def _balance(
        members: list[Member], holder: Mapping[str, str | None], by_id: Mapping[str, PoolView],
        count: dict[str, int],
    ) -> list[tuple[str, str]]:
        """Release requests: a pool outside its holder's pins (pins changed, or it held the
        lease before it joined) first; then toward balance: the fullest member without a
        pending request gives one pool to the emptiest member that could own it, while they
        differ by two or more (pending requests count as already moved). At most one request
        pending per member."""
        asks: list[tuple[str, str]] = []
        count = dict(count)
        busy: set[str] = set()
        for m in members:   # pending requests count as moved
            for pid in m.release_pool_ids:
                if holder.get(pid) == m.scheduler_id:
                    count[m.scheduler_id] -= 1
                    busy.add(m.scheduler_id)
        for m in members:
            if m.scheduler_id in busy:
                continue
            stray = sorted(pid for pid, h in holder.items() if h == m.scheduler_id and not m.can_own(pid))
            if stray:
                asks.append((m.scheduler_id, stray[0]))
                count[m.scheduler_id] -= 1
                busy.add(m.scheduler_id)
        for full in sorted(members, key=lambda m: (-count[m.scheduler_id], m.scheduler_id)):
            if full.scheduler_id in busy:
                continue
            mine = sorted(pid for pid, h in holder.items() if h == full.scheduler_id and by_id[pid].assignable)
            best: tuple[tuple[int, int, str], str, Member] | None = None
            for low in members:
                if low is full or count[full.scheduler_id] - count[low.scheduler_id] < 2:
                    continue
                movable = [pid for pid in mine if low.can_own(pid)]
                if not movable:
                    continue
                pid = min(movable, key=lambda p: (by_id[p].num_blocks, p))
                key = (count[low.scheduler_id], by_id[pid].num_blocks, low.scheduler_id)
                if best is None or key < best[0]:
                    best = (key, pid, low)
            if best is not None:
                _, pid, low = best
                asks.append((full.scheduler_id, pid))
                busy.add(full.scheduler_id)
                count[full.scheduler_id] -= 1
                count[low.scheduler_id] += 1
        return asks


__all__ = ["Fleet", "FleetPlan", "Member", "PoolView", "check_address"]
