"""The KV events stream in vLLM's wire format, on ZMQ, for the routers that read vLLM's stream.

llm-d's KV-cache manager and Dynamo's KV router index what every engine caches from vLLM's KV
events: a ZMQ PUB socket sending multipart `[topic, seq, payload]` (seq: 8 bytes big-endian,
one counter per socket; payload: msgpack of a `KVEventBatch`), and a ROUTER socket that
replays recent batches to a subscriber that missed some. `SubscribeKvEvents` (gRPC) says the
same things in its own terms; this module says them in vLLM's, so those routers work against
pagedkv unchanged. docs/kv_events.md has the format and how our terms map onto it.

Why inside the block manager and not a bridge process reading `SubscribeKvEvents`: the hub
already holds each block's token ids (referenced from the core's block metadata, not copied),
which vLLM's `BlockStored` carries and the gRPC stream does not; a bridge would need them on
the gRPC wire, a second process to deploy and watch, and a second hop of latency. Here the Step
path pays one deque append per published batch (`published`); everything else — translation,
msgpack encoding, ZMQ sends, replay — runs on one publisher thread that owns both sockets.

- **Topics.** One per node (`topic` with "{node}"), as one vLLM engine has its own topic: a
  router keyed by engine sees each node as one.
- **Batches.** The thread wakes every `interval_s` while there is work, takes everything
  published meanwhile and sends, per node, one batch of that node's events in the order they
  were published. With nothing queued it sleeps until `published` signals it (one inproc
  message when it goes from idle to busy; none while busy), so an idle block manager pays
  nothing for it.
- **Sequence numbers.** One counter for the socket, from 0, one per batch sent, strictly
  increasing (what vLLM's publisher does). A subscriber of a subset of the topics sees gaps
  where other nodes' batches went.
- **Replay.** The newest `buffer_batches` batches are held; a request `[start_seq]` (8 bytes,
  big-endian; optionally a second frame: a topic prefix) is answered with every held batch
  numbered at or above it, as `[topic, seq, payload]`, then `[b"", seq -1, b""]` (vLLM's end
  marker). vLLM's publisher answers with `[seq, payload]` in older versions and adds the topic
  in newer ones; with several topics on one socket the topic is what tells them apart.
- **Snapshots.** A consumer that starts late has no view and vLLM's format has no snapshot;
  so at every (re)start of the hub — a block manager start or takeover — the publisher sends,
  per node, `AllBlocksCleared` and then `BlockStored` of every block the recovered view holds
  (on the device, host and disk tiers). The same happens when the thread falls behind by
  more than `queue_batches` batches: what waits is dropped, and the snapshot (taken from the
  hub's view at that point of the stream) replaces it, after an `AllBlocksCleared` of every
  node that had blocks. A consumer's view is right again after it, never silently wrong.
- **Slow subscribers.** ZMQ PUB drops messages for a subscriber past the high-water mark and
  never blocks; ROUTER drops replies likewise. Nothing a subscriber does reaches the Step path.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import chain, count
from typing import Any

import msgspec
import zmq

from block_manager.core.kv_events import REMOVED, STORED
from block_manager.service.kv_events import Event, HubInfo, KvEventHub
from pagedkv.logging import get_logger

log = get_logger(__name__)

# vLLM's `medium` per tier: the device pool is the cache the model reads (vLLM's "GPU", also on a
# CPU node), the host tier is vLLM's CPU offload ("CPU"), the disk tier "DISK".
MEDIUM = {"device": "GPU", "host": "CPU", "disk": "DISK"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_EVENTS_PER_BATCH = 1024   # a snapshot of a large node goes out in batches of this many events
IDLE_POLL_MS = 100            # an idle thread checks for a stop this often (a publish wakes it at once)


class KvEventsZmqError(OSError):
    """The ZMQ publisher cannot start (an endpoint that cannot be bound)."""


def hash64(block_hash: bytes) -> int:
    """A block hash as vLLM's int form: the low 64 bits of the hash read big-endian (vLLM's
    `int.from_bytes(h, "big") & (2**64 - 1)`), which Dynamo requires and llm-d accepts."""
    return int.from_bytes(block_hash[-8:], "big")


EVENT_FORMATS = ("map", "array")


def vllm_events(ev: Event, event_format: str = "map") -> list[Any]:
    """One hub event as vLLM events, in vLLM's field order. `event_format` "map": each event a
    tagged map, `{"type": "BlockStored", "block_hashes": ..., ...}` (vLLM's current format: its
    `KVCacheEvent` structs are `tag=True`, not `array_like`; vLLM 0.32's own decoder accepts
    nothing else); "array": the tag first, then the fields positionally (vLLM's earlier
    `array_like` events, which older consumers decode). Either way defaults are left out as
    msgspec's `omit_defaults` does."""
    return [_wire(tag, fields, event_format) for tag, fields in _vllm_fields(ev)]


def _wire(tag: str, fields: dict[str, Any], event_format: str) -> Any:
    return {"type": tag, **fields} if event_format == "map" else [tag, *fields.values()]


def _vllm_fields(ev: Event) -> list[tuple[str, dict[str, Any]]]:
    tier = ev.tier
    from_bytes = int.from_bytes
    if ev.kind == STORED:
        tokens_per_block = ev.token_ids
        if tokens_per_block is None or None in tokens_per_block:
            raise KvEventsZmqError(f"stored blocks of node {ev.node_id!r} without their token ids")
        num_blocks = len(ev.block_hashes)
        stored: dict[str, Any] = {
            "block_hashes": [from_bytes(h[-8:], "big") for h in ev.block_hashes],
            "parent_block_hash": None if ev.parent_hash is None else hash64(ev.parent_hash),
            "token_ids": list(chain.from_iterable(tokens_per_block)),
            "block_size": ev.num_tokens // num_blocks,
            "lora_id": None, "medium": MEDIUM[tier], "lora_name": None,   # type: ignore[index]  # a stored event names its tier
        }
        if ev.salt_id:
            # extra_keys: one entry per block, as in vLLM; ours holds the salt's id (the salt
            # is part of every block's hash, and may be a tenant's secret)
            stored["extra_keys"] = [[ev.salt_id]] * num_blocks
        return [("BlockStored", stored)]
    if ev.kind == REMOVED:
        return [("BlockRemoved", {"block_hashes": [from_bytes(h[-8:], "big") for h in ev.block_hashes],
                                  "medium": MEDIUM[tier]})]   # type: ignore[index]  # so does a removal
    if tier is None:
        return [("AllBlocksCleared", {})]
    # one tier of a node cleared (reset-prefix-cache): vLLM has no per-medium clear, and its
    # AllBlocksCleared would drop the node's other tiers from a consumer's view
    if not ev.block_hashes:
        return []
    return [("BlockRemoved", {"block_hashes": [hash64(h) for h in ev.block_hashes], "medium": MEDIUM[tier]})]


def snapshot_events(node: str, tier: str, entries: dict[bytes, HubInfo]) -> list[Event]:
    """A tier's view as BlockStored events, chains coalesced as the hub coalesces them."""
    out: list[Event] = []
    last: Event | None = None
    for h, (parent, sid, n, tokens) in entries.items():
        if (last is not None and last.salt_id == sid and last.block_hashes[-1] == parent
                and last.num_tokens == n * len(last.block_hashes)):
            last.block_hashes.append(h)
            last.num_tokens += n
            last.token_ids.append(tokens)   # type: ignore[union-attr, arg-type]  # a snapshot's blocks carry their ids
            continue
        last = Event(0, STORED, node, tier, [h], parent, n, sid, token_ids=[tokens])   # type: ignore[list-item]  # as above
        out.append(last)
    return out


class ZmqKvEventPublisher:
    """Publishes a `KvEventHub`'s events on ZMQ in vLLM's format (see the module docstring).

    `start()` binds and starts the thread (on the event loop's thread); `close()` sends what
    is queued, closes both sockets and the context."""

    def __init__(
        self, hub: KvEventHub, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "kv@{node}",
        buffer_batches: int = 10_000, queue_batches: int = 10_000, hwm: int = 100_000, interval_s: float = 0.005,
        data_parallel_rank: int = 0, nodes: Callable[[], Iterable[str]] | None = None, event_format: str = "map",
    ) -> None:
        if event_format not in EVENT_FORMATS:
            raise ValueError(f"event_format must be one of {EVENT_FORMATS}, got {event_format!r}")
        self.event_format = event_format
        self.hub = hub
        # every node the block manager knows (with blocks or not): a snapshot clears each, so a
        # consumer drops what it held of a node that came back from a restart with nothing
        self.nodes = nodes
        self.requested_endpoint = endpoint
        self.requested_replay_endpoint = replay_endpoint
        self.topic = topic
        self.queue_batches = queue_batches
        self.hwm = hwm
        self.interval_s = max(interval_s, 0.001)
        self.data_parallel_rank = data_parallel_rank
        self.endpoint: str | None = None            # as bound (an ephemeral port resolved)
        self.replay_endpoint: str | None = None
        # ("events", [Event]) | ("snapshot", ([((node, tier), {hash: info})], {node})); appended on the
        # event loop's thread, taken by the publisher thread (deque: atomic append/popleft)
        self._queue: deque[tuple[str, Any]] = deque()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_batches)   # (seq, topic, payload)
        self._seq = count()
        self._topics: dict[str, bytes] = {}
        self._nodes: set[str] = set()               # nodes a consumer may hold blocks of
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        # inproc pair: the event loop's end signals the idle thread (one send when it goes from
        # idle to busy, none while busy); each end is used by one thread only, as ZMQ requires
        self._wake_tx: zmq.Socket[Any] | None = None
        self._wake_rx: zmq.Socket[Any] | None = None
        self._idle = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.num_batches = 0
        self.num_snapshots = 0
        self.num_overflows = 0
        self.num_replays = 0
        self.num_errors = 0

    @classmethod
    def from_settings(
        cls, hub: KvEventHub, ev: Any, nodes: Callable[[], Iterable[str]] | None = None
    ) -> ZmqKvEventPublisher:
        """From `BlockManagerConfig.kv_events` (service/config.py)."""
        return cls(hub, ev.zmq_endpoint, replay_endpoint=ev.zmq_replay_endpoint, topic=ev.zmq_topic,
                   buffer_batches=ev.zmq_buffer_batches, queue_batches=ev.zmq_queue_batches, hwm=ev.zmq_hwm,
                   interval_s=ev.batch_interval_s, nodes=nodes, event_format=ev.zmq_event_format)

    # ---- lifecycle (event loop thread) ----------------------------------------------------
    def start(self) -> None:
        """Bind both sockets, start the thread, and follow the hub (a snapshot of what it
        holds now goes out first, if anything)."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._ctx = zmq.Context()
        try:
            self._pub = self._bind(zmq.PUB, self.requested_endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.requested_replay_endpoint is not None:
                self._replay = self._bind(zmq.ROUTER, self.requested_replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            wake = f"inproc://kv-events-zmq-wake-{id(self)}"
            self._wake_rx = self._ctx.socket(zmq.PAIR)
            self._wake_rx.bind(wake)
            self._wake_tx = self._ctx.socket(zmq.PAIR)
            self._wake_tx.setsockopt(zmq.SNDHWM, 1)
            self._wake_tx.connect(wake)
        except BaseException:
            self._close_sockets()
            raise
        self.hub.add_sink(self)
        self.restarted()
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        log.info("kv events zmq publisher", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                 topic=self.topic)

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[Any]:
        sock = self._ctx.socket(kind)   # type: ignore[union-attr]  # bound only after start() made the context
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            endpoint = endpoint[:-1] + "*"   # libzmq's spelling of an ephemeral port
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise KvEventsZmqError(f"cannot bind the KV events ZMQ endpoint {endpoint!r}: {exc}") from None
        return sock

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close both sockets and the context (idempotent)."""
        self.hub.remove_sink(self)
        self._stopping = True
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("kv events zmq publisher thread did not stop", timeout_s=timeout_s)
                return   # it still owns the sockets: closing them under it would crash it
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay, self._wake_rx, self._wake_tx):
            if sock is not None:
                sock.close(linger=0 if sock in (self._wake_rx, self._wake_tx) else None)
        self._pub = self._replay = self._wake_rx = self._wake_tx = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---- the hub's side (event loop thread, the Step path) -----------------------------------
    def published(self, events: list[Event]) -> None:
        """O(1): the batch waits for the thread; over `queue_batches` waiting, everything
        waiting is dropped for a snapshot of the hub's view as of this batch."""
        queue = self._queue
        if len(queue) < self.queue_batches:
            queue.append(("events", events))
            if self._idle:
                self._signal()
            return
        queue.clear()
        self.num_overflows += 1
        log.warning("kv events zmq publisher fell behind; sending a snapshot instead", queued=self.queue_batches)
        self.restarted()

    def restarted(self) -> None:
        """The view as of now (C-level copies of the hub's dicts) goes out next, each node's
        after an AllBlocksCleared."""
        known = set(self.nodes()) if self.nodes is not None else set()
        self._queue.append(("snapshot", ([(key, dict(entries)) for key, entries in self.hub.view.items()], known)))
        if self._idle:
            self._signal()

    def _signal(self) -> None:
        """Wake the idle thread (the event loop's end of the pair; never blocks: one message
        at most waits, a second is dropped as it would say nothing more)."""
        self._idle = False
        if self._wake_tx is not None:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    # ---- the publisher thread ---------------------------------------------------------------
    def _run(self) -> None:
        """Busy: every `interval_s` take what was published meanwhile and send it. Idle (nothing
        queued): sleep in a poll of the replay and wake sockets until `published` signals."""
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        wait_ms = int(self.interval_s * 1000) or 1
        idle = False
        while True:
            stopping = self._stopping
            try:
                if idle:
                    self._idle = True
                    if not self._queue and not stopping:   # else something came meanwhile
                        ready = dict(poller.poll(IDLE_POLL_MS))
                        if self._wake_rx in ready:
                            while self._wake_rx.poll(0):   # type: ignore[union-attr]  # set by start()
                                self._wake_rx.recv(zmq.NOBLOCK)   # type: ignore[union-attr]  # set by start()
                        if self._replay is not None and self._replay in ready:
                            self._serve_replays()
                    self._idle = False
                # coalesce: what is published within the interval goes in one batch per node
                ready = dict(poller.poll(0 if stopping else wait_ms))
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                items = []
                while self._queue:
                    items.append(self._queue.popleft())
                if items:
                    self._send(items, encoder)
                idle = not self._queue
            except Exception as exc:  # noqa: BLE001 - one bad batch must not end the stream
                self.num_errors += 1
                log.exception("kv events zmq publisher: a batch was lost; sending a snapshot", error=repr(exc))
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(self.restarted)
            if stopping and not self._queue:
                break

    def _send(self, items: list[tuple[str, Any]], encoder: msgspec.msgpack.Encoder) -> None:
        per_node: dict[str, list[Any]] = {}
        fmt = self.event_format
        for kind, payload in items:
            if kind == "events":
                for ev in payload:
                    per_node.setdefault(ev.node_id, []).extend(vllm_events(ev, fmt))
                    if ev.kind == STORED:
                        self._nodes.add(ev.node_id)
                    elif ev.kind not in (STORED, REMOVED) and ev.tier is None:
                        self._nodes.discard(ev.node_id)
                continue
            self.num_snapshots += 1
            view, known = payload
            holding = {node for (node, _tier), entries in view if entries}
            for node in sorted(self._nodes | holding | known):
                per_node.setdefault(node, []).append(_wire("AllBlocksCleared", {}, fmt))
            for (node, tier), entries in view:
                for ev in snapshot_events(node, tier, entries):
                    per_node[node].extend(vllm_events(ev, fmt))
            self._nodes = holding
        pub = self._pub
        if pub is None:
            return
        for node, events in per_node.items():
            topic = self._topics.get(node)
            if topic is None:
                topic = self._topics[node] = self.topic.format(node=node).encode()
            for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
                batch = [time.time(), events[i:i + MAX_EVENTS_PER_BATCH], self.data_parallel_rank]
                payload = encoder.encode(batch)
                seq = next(self._seq)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, topic, payload))
                self.num_batches += 1

    def _serve_replays(self) -> None:
        """Answer every replay request waiting (ROUTER: never blocks; replies past the
        high-water mark are dropped by ZMQ)."""
        sock = self._replay
        while sock is not None:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident = frames[0]
            if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("kv events zmq: malformed replay request", frames=len(frames))
                sock.send_multipart((ident, b"", b"", END_SEQ, b""))
                continue
            self.num_replays += 1
            start = int.from_bytes(frames[2], "big")
            prefix = frames[3] if len(frames) == 4 else b""
            for seq, topic, payload in list(self._buffer):
                if seq >= start and topic.startswith(prefix):
                    sock.send_multipart((ident, b"", topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((ident, b"", b"", END_SEQ, b""))


__all__ = ["END_SEQ", "MEDIUM", "KvEventsZmqError", "ZmqKvEventPublisher", "hash64", "snapshot_events",
           "vllm_events"]
