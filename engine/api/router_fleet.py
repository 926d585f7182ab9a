"""What the router knows about the fleet, and where it sends one request (`pagedkv-router`).

The block manager is the router's only source: its `Route` answer ranks every pool for a prompt
(longest cached prefix first) and names, per pool, the fleet member that owns it with that
member's API address and load (`RouteEntry.scheduler_*`, docs/router.md). The router keeps no
KV index of its own; it cannot disagree with the block manager about what is cached where.

`Fleet` holds the engines: those the block manager last named as owners (refreshed in the
background, so a router that has served nothing yet is ready once an engine joined), plus the
static `--engines` used only while the block manager names no owner at all. `plan` orders the
engines to try for one request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from block_manager.client.types import PoolRoute

# An engine that failed before the first byte (refused, dropped, 5xx) is tried last for this
# long: a dead replica costs one failed attempt, not one per request, until its lease lapses.
COOLDOWN_S = 5.0


class RoutedBy(str, Enum):
    """Why a request went where it went (the `/metrics` counters are per reason)."""

    PREFIX = "prefix"     # the owner of the pool with the longest cached prefix
    LOAD = "load"         # nothing cached anywhere (or the block manager did not answer): least loaded
    BALANCE = "balance"   # the prefix owner is far busier than the least loaded member, which serves
    STATIC = "static"     # the block manager names no owner: the static --engines, least loaded


@dataclass(slots=True)
class EngineView:
    """One upstream engine as the router sees it. `num_running` / `num_waiting` are the block
    manager's view (the member's last heartbeat, up to ttl/3 old); `num_in_flight` counts the
    requests this router has open there right now, so a burst between two heartbeats spreads
    instead of piling onto the engine that looked idle."""

    url: str
    scheduler_id: str = ""
    num_running: int = 0
    num_waiting: int = 0
    num_in_flight: int = 0
    static: bool = False
    cooldown_until: float = 0.0

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.num_in_flight

    def cooling(self, now: float) -> bool:
        return now < self.cooldown_until


@dataclass(slots=True, frozen=True)
class RoutePlan:
    """The engines to try, in order (the first that answers serves the request), and why the
    first was chosen; `num_cached_tokens` is what its pool holds of the prompt (0: none)."""

    urls: tuple[str, ...]
    routed_by: RoutedBy
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0


def normalize_url(url: str) -> str:
    """`host:port` or a base URL, as `http://host:port` without a trailing slash."""
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


@dataclass
class Fleet:
    """The engines the router may forward to: the fleet members the block manager named in its
    last full answer (`replace`), loads refreshed by every per-request answer (`observe`), and
    the static fallback list."""

    static_urls: Sequence[str] = ()
    max_imbalance: int = 16
    members: dict[str, EngineView] = field(default_factory=dict)
    statics: dict[str, EngineView] = field(init=False, default_factory=dict)
    _turns: itertools.count[int] = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.statics = {u: EngineView(u, static=True) for u in map(normalize_url, self.static_urls)}

    @property
    def num_known(self) -> int:
        return len(self.members) + len(self.statics)

    def replace(self, entries: Iterable[PoolRoute]) -> None:
        """A full view (every pool, from the background refresh): members that own no pool any
        more are forgotten (their lease lapsed or they left; their pools went to others)."""
        owners = _owners(entries)
        for url in list(self.members):
            if url not in owners:
                del self.members[url]
        self.observe_owners(owners)

    def observe(self, entries: Iterable[PoolRoute]) -> None:
        """A per-request answer: fresher loads, and owners not seen before."""
        self.observe_owners(_owners(entries))

    def observe_owners(self, owners: dict[str, PoolRoute]) -> None:
        for url, e in owners.items():
            view = self.members.get(url)
            if view is None:
                view = self.members[url] = EngineView(url)
            view.scheduler_id = e.scheduler_id
            view.num_running = e.scheduler_num_running
            view.num_waiting = e.scheduler_num_waiting

    def view(self, url: str) -> EngineView | None:
        return self.members.get(url) or self.statics.get(url)

    def failed(self, url: str) -> None:
        """`url` failed before its first byte: try it last for a while (`COOLDOWN_S`)."""
        view = self.view(url)
        if view is not None:
            view.cooldown_until = time.monotonic() + COOLDOWN_S

    def by_load(self, views: Iterable[EngineView]) -> list[str]:
        """Engines cooling down last, then least loaded first; equal loads take turns (a new
        prefix lands on each idle engine in turn, not always on the same one)."""
        ordered = sorted(views, key=lambda v: v.url)
        if ordered:
            turn = next(self._turns) % len(ordered)
            ordered = ordered[turn:] + ordered[:turn]
        now = time.monotonic()
        return [v.url for v in sorted(ordered, key=lambda v: (v.cooling(now), v.load))]

    def plan(self, entries: Sequence[PoolRoute] | None) -> RoutePlan:
        """The order to try engines in for a prompt the block manager ranked as `entries`
        (None: it did not answer; the last known members are used, by load).

        The owner of the pool holding the longest cached prefix comes first, unless it failed
        moments ago or has more than `max_imbalance` requests beyond the least loaded member
        (that one then serves, its node fetching the prefix: a hot prefix must not pin its
        traffic to one replica while others idle); every other member follows by load (the
        retry order). Only when no member is known at all do the static engines serve, by this
        router's own in-flight count."""
        if entries is not None:
            self.observe(entries)
        if not self.members:
            return RoutePlan(tuple(self.by_load(self.statics.values())), RoutedBy.STATIC)
        by_load = self.by_load(self.members.values())
        best = max((e for e in entries or () if e.scheduler_address), key=lambda e: e.num_cached_tokens, default=None)
        if best is None or best.num_cached_tokens == 0:
            return RoutePlan(tuple(by_load), RoutedBy.LOAD)
        first = normalize_url(best.scheduler_address)
        owner = self.members[first]
        if owner.cooling(time.monotonic()):
            return RoutePlan(tuple(by_load), RoutedBy.LOAD)       # its owner failed moments ago: tried last
        if owner.load > self.members[by_load[0]].load + self.max_imbalance:
            return RoutePlan(tuple(by_load), RoutedBy.BALANCE)    # the least loaded fetches the prefix instead
        return RoutePlan((first, *(u for u in by_load if u != first)), RoutedBy.PREFIX, best.num_cached_tokens)


def _owners(entries: Iterable[PoolRoute]) -> dict[str, PoolRoute]:
    """Owner URL -> one of its entries (a member owning several pools reports one load)."""
    return {normalize_url(e.scheduler_address): e for e in entries if e.scheduler_address}


__all__ = ["EngineView", "Fleet", "RoutePlan", "RoutedBy", "normalize_url"]
