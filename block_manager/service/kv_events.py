"""The KV events stream, service side: numbering, history, a view, subscribers.

The core records every prefix-index change (`core/kv_events.py`). The runtime hands each
mutating op's changes to `KvEventHub.stage` right after the op is applied, and calls
`commit` once the op's journal record is committed: only then are they numbered and
published, in the order the ops were applied (a staged op waits for the ones before it).
So a subscriber never sees a change a crash could take back, and event ids can be tied to
the journal:

- **Ids.** A process starts at `base = (journal's last seq_no + 1) << 32` (its *boot mark*:
  the head before its first event) and counts up by one per event. Every event a process
  published belongs to a committed record, each record has fewer than 2^32 events, so a
  restart's base is above every id published before it: ids keep increasing across restarts
  and a standby's takeover, and an id from an earlier process is never mistaken for a newer
  one. A volatile server (`memory://`) has no journal: its base is the wall clock in
  microseconds (it would have to publish more than one event per microsecond of its life to
  overlap the next process).
- **Resume.** The newest `history_events` events are held in memory (a deque): a subscriber
  that names the last id it applied continues exactly after it while that id is the head or
  the next id is held. Anything else — 0, an id from before a restart, one pushed out of the
  history, one from the future — gets a `Resync`, then a snapshot of the view as of the head
  (BlockStored entries carrying the head's id), a `KvSnapshotEnd`, then live events. The
  journal is not read back for events: it records requests, not their effects, and the
  in-memory history already covers the common case (a subscriber reconnecting after a blip).
- **View.** The hub keeps what the published events describe (node, tier) -> {hash: (parent,
  salt id, tokens, token ids)}, updated per event (the token ids are the core's own tuples,
  referenced, not copied: what a vLLM-format snapshot needs, service/kv_events_zmq.py); a
  snapshot is a copy of its dicts (C-level copies, not a walk of the core), so a Resync costs
  the Step path little.
- **Slow subscribers.** Each subscriber has a bounded queue (`subscriber_buffer_events`);
  publishing appends one batch per subscriber (O(1), never awaits). A subscriber is sent at
  most one live message per `batch_interval_s`: batches published meanwhile go together. A subscriber whose queue
  would overflow has it cleared and is marked for a Resync, which it gets as soon as it reads
  again. Nothing a subscriber does reaches the Step path.
- **Sinks.** Other publishers of the same numbered events (the vLLM-format ZMQ publisher,
  service/kv_events_zmq.py) register with `add_sink`: each published batch is handed to them
  as it is to subscribers (their `published` must be O(1) and never wait), and a `reset`
  tells them (`restarted`) so they can describe the recovered view.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from block_manager.core.kv_events import CLEARED, REMOVED, STORED, IndexView, KvChange
from block_manager.service.errors import ServerUnavailable
from pagedkv.logging import get_logger

log = get_logger(__name__)

ID_SHIFT = 32
MAX_EVENTS_PER_MESSAGE = 512
# (node, tier) -> {hash: (parent hash | None, salt id, tokens, token ids | None)}
# (token ids are None only for a view handed to `reset` without them)
HubInfo = tuple[bytes | None, str, int, tuple[int, ...] | None]
HubView = dict[tuple[str, str], dict[bytes, HubInfo]]


def salt_id(salt: str | None) -> str:
    """Names a salt without revealing it (a salt may be a tenant's secret)."""
    return "" if salt is None else hashlib.blake2b(salt.encode(), digest_size=8).hexdigest()


def journal_base(last_seq_no: int) -> int:
    return (last_seq_no + 1) << ID_SHIFT


def volatile_base() -> int:
    return time.time_ns() // 1000


@dataclass(slots=True)
class Event:
    """One numbered event (a chain of stored blocks, a set of removed ones, or a clear).

    A clear of one tier lists the hashes it dropped in `block_hashes` (a vLLM-format stream,
    which has no per-tier clear, says `BlockRemoved` of them); a clear of every tier lists none."""

    event_id: int
    kind: str                      # STORED, REMOVED, CLEARED
    node_id: str
    tier: str | None
    block_hashes: list[bytes]
    parent_hash: bytes | None = None
    num_tokens: int = 0
    salt_id: str = ""
    encoded: Any = None            # its wire form, built once for all subscribers (servicer's codec)
    token_ids: list[tuple[int, ...]] | None = None   # STORED: each block's token ids (referenced)


class HubSink(Protocol):
    """Another publisher of the hub's events (service/kv_events_zmq.py)."""

    def published(self, events: list[Event]) -> None:
        """One published batch, in order; O(1), never waits (it runs on the Step path)."""

    def restarted(self) -> None:
        """The hub was reset to a recovered view (a start or a takeover)."""


# (node, tier, hash, parent hash | None, salt id, tokens): one block of a snapshot
SnapshotBlock = tuple[str, str, bytes, bytes | None, str, int]


@dataclass(slots=True)
class Frame:
    """One message of a subscriber's stream: live `events`; a `resync` marker; `snapshot`
    blocks as of `event_id`; `snapshot_end` (its last blocks and the count)."""

    kind: str
    event_id: int
    events: list[Event] | None = None
    blocks: list[SnapshotBlock] | None = None
    reason: str = ""
    num_blocks: int = 0


class Subscription:
    """One subscriber's bounded queue and what it must be sent next."""

    __slots__ = ("capacity", "queue", "num_queued", "wake", "overflowed", "closed", "backlog", "snapshot",
                 "snapshot_id", "reason", "num_overflows")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queue: deque[list[Event]] = deque()
        self.num_queued = 0
        self.wake = asyncio.Event()
        self.overflowed = False
        self.closed: str | None = None            # why the stream must end
        self.backlog: list[Event] = []            # held events after the resume point
        self.snapshot: list[tuple[tuple[str, str], dict]] | None = None
        self.snapshot_id = 0
        self.reason = ""
        self.num_overflows = 0

    def offer(self, batch: list[Event]) -> None:
        """Enqueue one published batch; never blocks. Over capacity: drop to a Resync."""
        if self.overflowed or self.closed is not None:
            return
        n = self.num_queued + len(batch)
        if n > self.capacity:
            self.queue.clear()
            self.num_queued = 0
            self.overflowed = True
            self.num_overflows += 1
        else:
            self.queue.append(batch)
            self.num_queued = n
        self.wake.set()

    def take(self, limit: int) -> list[Event]:
        out: list[Event] = []
        while self.queue and len(out) < limit:
            batch = self.queue.popleft()
            self.num_queued -= len(batch)
            out.extend(batch)
        return out

    def close(self, reason: str) -> None:
        self.closed = reason
        self.wake.set()


class KvEventHub:
    """Numbers staged changes once committed, keeps the history and the view, feeds subscribers."""

    def __init__(
        self, history_events: int = 100_000, subscriber_buffer_events: int = 10_000, batch_interval_s: float = 0.0
    ) -> None:
        self.history: deque[Event] = deque(maxlen=history_events)
        self.buffer_events = subscriber_buffer_events
        self.batch_interval_s = batch_interval_s
        self.head = 0
        self.boot_id = 0
        self.view: HubView = {}
        self.subscribers: set[Subscription] = set()
        self._staged: deque[list[Any]] = deque()   # [changes, committed]
        self._salt_ids: dict[str, str] = {}
        self.sinks: list[HubSink] = []
        self.num_published = 0
        self.num_resyncs = 0
        self.num_overflows = 0

    # ---- lifecycle ------------------------------------------------------------------
    def reset(self, base: int, view: IndexView) -> None:
        """A (re)start: the view is the recovered core's, the head is the boot mark `base`;
        subscribers of the previous incarnation are closed (they reconnect and resync)."""
        self.close_all("block manager restarted its event stream")
        self.head = self.boot_id = base
        self.history.clear()
        self._staged.clear()
        self.view = {(pid, tier): {h: (info[0], self._salt_id(info[1]), info[2], info[3] if len(info) > 3 else None)
                                   for h, info in entries.items()}
                     for (pid, tier), entries in view.items()}
        for sink in self.sinks:
            sink.restarted()

    def add_sink(self, sink: HubSink) -> None:
        """`sink` gets every batch published from now on (and hears of every reset)."""
        self.sinks.append(sink)

    def remove_sink(self, sink: HubSink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)

    def close_all(self, reason: str) -> None:
        for sub in self.subscribers:
            sub.close(reason)
        self.subscribers.clear()

    # ---- the Step path --------------------------------------------------------------
    def stage(self, changes: list[KvChange]) -> list[Any] | None:
        """Changes of an op just applied (O(1)); publish them with `commit(ticket)`."""
        if not changes:
            return None
        ticket = [changes, False]
        self._staged.append(ticket)
        return ticket

    def commit(self, ticket: list[Any] | None) -> None:
        """The op's record is durable: publish its changes once every earlier op's are."""
        if ticket is None:
            return
        ticket[1] = True
        staged = self._staged
        while staged and staged[0][1]:
            self._publish(staged.popleft()[0])

    def abandon(self, ticket: list[Any] | None, reason: str) -> None:
        """The op's record never became durable (the server stops): its changes are never
        published, and no subscriber may go on with a view the journal does not back."""
        if ticket is not None:
            ticket[0], ticket[1] = [], True
            self.commit(ticket)
        self.close_all(reason)

    def _salt_id(self, salt: str | None) -> str:
        if salt is None:
            return ""
        sid = self._salt_ids.get(salt)
        if sid is None:
            if len(self._salt_ids) > 4096:
                self._salt_ids.clear()
            sid = self._salt_ids[salt] = salt_id(salt)
        return sid

    def _publish(self, changes: list[KvChange]) -> None:
        events = self._coalesce(changes)
        self.history.extend(events)
        self.num_published += len(events)
        for sub in self.subscribers:
            sub.offer(events)
        for sink in self.sinks:
            sink.published(events)

    def _coalesce(self, changes: Iterable[KvChange]) -> list[Event]:
        """Number the changes, merging runs: a chain of stored blocks (same node, tier and
        salt, each the parent of the next) is one BlockStored; removals of one tier one
        BlockRemoved. Updates the view as it goes."""
        events: list[Event] = []
        view = self.view
        last: Event | None = None
        stored_key: tuple[str, str] | None = None   # the view entries of the last stored change's tier
        stored_in: dict[bytes, HubInfo] = {}
        for c in changes:
            kind, node = c[0], c[1]
            if kind == STORED:
                _, _, tier, h, parent, salt, n, tokens = c
                sid = self._salt_id(salt)
                if stored_key != (node, tier):
                    stored_key = (node, tier)
                    stored_in = view.setdefault(stored_key, {})
                stored_in[h] = (parent, sid, n, tokens)
                if (last is not None and last.kind == STORED and last.node_id == node and last.tier == tier
                        and last.salt_id == sid and last.block_hashes[-1] == parent):
                    last.block_hashes.append(h)
                    last.num_tokens += n
                    last.token_ids.append(tokens)   # type: ignore[union-attr]  # a stored event holds its ids
                    continue
                last = Event(self.head + 1, STORED, node, tier, [h], parent, n, sid, token_ids=[tokens])
            elif kind == REMOVED:
                stored_key = None   # (the tier's entries may go from the view)
                tier, h = c[2], c[3]
                entries = view.get((node, tier))
                if entries is not None:
                    entries.pop(h, None)
                    if not entries:
                        del view[(node, tier)]
                if last is not None and last.kind == REMOVED and last.node_id == node and last.tier == tier:
                    last.block_hashes.append(h)
                    continue
                last = Event(self.head + 1, REMOVED, node, tier, [h])
            else:
                stored_key = None
                tier = c[2]
                dropped: list[bytes] = []
                for key in [k for k in view if k[0] == node and (tier is None or k[1] == tier)]:
                    if tier is not None:
                        dropped.extend(view[key])
                    del view[key]
                last = Event(self.head + 1, CLEARED, node, tier, dropped)
            self.head += 1
            events.append(last)
        return events

    # ---- subscribers ----------------------------------------------------------------
    def subscribe(self, from_event_id: int, live_only: bool) -> Subscription:
        """A new subscriber: resumed after `from_event_id` when held, else marked for a Resync
        (its snapshot taken now, so it matches the head exactly)."""
        sub = Subscription(self.buffer_events)
        if not live_only:
            backlog = self._held_after(from_event_id)
            if backlog is None:
                reason = "no view yet" if from_event_id == 0 else f"event {from_event_id} is not held"
                self.resync(sub, reason)
            else:
                sub.backlog = backlog
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)

    def _held_after(self, from_event_id: int) -> list[Event] | None:
        if from_event_id == self.head:
            return []
        if not self.history or from_event_id > self.head:
            return None
        first = self.history[0].event_id
        if from_event_id + 1 < first:
            return None
        return list(islice(self.history, from_event_id + 1 - first, None))

    def resync(self, sub: Subscription, reason: str) -> None:
        """Drop what `sub` has queued; it gets the view as of the head, then live events."""
        sub.queue.clear()
        sub.num_queued = 0
        sub.backlog = []
        sub.overflowed = False
        sub.snapshot = [(key, dict(entries)) for key, entries in self.view.items()]
        sub.snapshot_id = self.head
        sub.reason = reason
        self.num_resyncs += 1
        sub.wake.set()

    async def stream(self, sub: Subscription) -> AsyncIterator[Frame]:
        """What one subscriber is sent, frame by frame, until its stream is closed (then
        `ServerUnavailable`: the subscriber reconnects with the last id it applied)."""
        while True:
            if sub.closed is not None:
                raise ServerUnavailable(sub.closed)
            if sub.overflowed:
                self.num_overflows += 1
                log.warning("kv events subscriber too slow; dropped to a resync", buffer=sub.capacity)
                self.resync(sub, "subscriber buffer overflow")
            if sub.snapshot is not None:
                async for frame in self._send_snapshot(sub):
                    yield frame
                continue
            if sub.backlog:
                chunk, sub.backlog = sub.backlog[:MAX_EVENTS_PER_MESSAGE], sub.backlog[MAX_EVENTS_PER_MESSAGE:]
                yield Frame("events", chunk[-1].event_id, events=chunk)
                continue
            events = sub.take(MAX_EVENTS_PER_MESSAGE)
            if events:
                yield Frame("events", events[-1].event_id, events=events)
                if self.batch_interval_s > 0 and not sub.queue:
                    # at most one live message per interval: what is published meanwhile rides
                    # in the next one (fewer, larger writes; events at most this late)
                    await asyncio.sleep(self.batch_interval_s)
                continue
            sub.wake.clear()
            await sub.wake.wait()

    async def _send_snapshot(self, sub: Subscription) -> AsyncIterator[Frame]:
        snapshot, sid = sub.snapshot or [], sub.snapshot_id
        sub.snapshot = None
        yield Frame("resync", sid, reason=sub.reason)
        num_blocks = 0
        batch: list[SnapshotBlock] = []
        for (node, tier), entries in snapshot:
            for h, (parent, salt, n, _tokens) in entries.items():
                batch.append((node, tier, h, parent, salt, n))
                num_blocks += 1
                if len(batch) >= MAX_EVENTS_PER_MESSAGE:
                    yield Frame("snapshot", sid, blocks=batch)
                    batch = []
                    if sub.overflowed or sub.closed is not None:
                        return   # the caller starts over (a new Resync) or ends the stream
        yield Frame("snapshot_end", sid, blocks=batch, num_blocks=num_blocks)


__all__ = ["Event", "Frame", "HubSink", "HubView", "KvEventHub", "SnapshotBlock", "Subscription", "journal_base",
           "salt_id", "volatile_base"]
