"""The KV event hub without a server: numbering and coalescing, resume boundaries, the bounded
queue, and the wire form (live frames are joined pre-serialized entries that must parse as the
message the protobuf library would build)."""

from __future__ import annotations

import hashlib

from block_manager.core.kv_events import CLEARED, REMOVED, STORED
from block_manager.service.kv_events import Frame, KvEventHub, salt_id
from block_manager.service.kv_events_codec import frame_bytes, frame_pb
from pagedkv.v1 import block_manager_pb2 as pb


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def stored(i: int, parent: int | None, pool: str = "n1", tier: str = "device", salt: str | None = None) -> tuple:
    return (STORED, pool, tier, h(i), None if parent is None else h(parent), salt, 16, tuple(range(i, i + 16)))


def test_chains_coalesce_and_everything_else_keeps_its_order() -> None:
    hub = KvEventHub(history_events=100)
    hub.reset(1000, {})
    ticket = hub.stage([
        stored(1, None), stored(2, 1), stored(3, 2),          # one chain: one event
        stored(4, 9),                                          # parent is not the last: new event
        stored(5, 4, salt="t"),                                # another salt: new event
        (REMOVED, "n1", "device", h(1)), (REMOVED, "n1", "device", h(2)),   # one event
        (REMOVED, "n1", "host", h(7)),                         # another tier: new event
        (CLEARED, "n2", None),
    ])
    assert hub.head == 1000   # staged, not published
    hub.commit(ticket)
    events = list(hub.history)
    assert [e.event_id for e in events] == list(range(1001, 1007)) and hub.head == 1006
    assert [(e.kind, e.tier, len(e.block_hashes)) for e in events] == [
        (STORED, "device", 3), (STORED, "device", 1), (STORED, "device", 1), (REMOVED, "device", 2),
        (REMOVED, "host", 1), (CLEARED, None, 0)]
    assert events[0].num_tokens == 48 and events[0].parent_hash is None and events[2].salt_id == salt_id("t")
    # the view: what is left on n1's device (n2 cleared, nothing was on n1's host)
    t = lambda i: tuple(range(i, i + 16))   # noqa: E731 - the token ids `stored(i)` carries
    assert hub.view == {("n1", "device"): {h(3): (h(2), "", 16, t(3)), h(4): (h(9), "", 16, t(4)),
                                           h(5): (h(4), salt_id("t"), 16, t(5))}}


def test_commits_publish_in_apply_order() -> None:
    hub = KvEventHub()
    hub.reset(0, {})
    first, second = hub.stage([stored(1, None)]), hub.stage([stored(2, None)])
    hub.commit(second)               # committed first, but applied second: waits
    assert hub.head == 0
    hub.commit(first)
    assert [e.block_hashes for e in hub.history] == [[h(1)], [h(2)]]


def test_resume_boundaries() -> None:
    hub = KvEventHub(history_events=3)
    hub.reset(100, {})
    for i in range(5):
        hub.commit(hub.stage([stored(i, None)]))
    assert [e.event_id for e in hub.history] == [103, 104, 105]
    assert [e.event_id for e in hub._held_after(102)] == [103, 104, 105]
    assert hub._held_after(105) == []
    for gone in (0, 101, 106, 10**12):
        assert hub._held_after(gone) is None


def test_an_overflowing_subscriber_is_marked_for_resync() -> None:
    hub = KvEventHub(subscriber_buffer_events=2)
    hub.reset(0, {})
    sub = hub.subscribe(0, live_only=True)
    hub.commit(hub.stage([stored(1, None), stored(5, None)]))
    assert sub.num_queued == 2 and not sub.overflowed
    hub.commit(hub.stage([stored(9, None)]))
    assert sub.overflowed and sub.num_queued == 0 and not sub.queue and sub.num_overflows == 1


def test_live_frames_serialize_as_protobuf_would() -> None:
    hub = KvEventHub()
    hub.reset(7 << 32, {})
    chain = [stored(i, i - 1 if i else None) for i in range(300)]   # entries longer than 127 bytes
    hub.commit(hub.stage([*chain, (REMOVED, "n1", "host", h(3)), (CLEARED, "n1", "device")]))
    frame = Frame("events", hub.head, events=list(hub.history))
    wire = frame_bytes(frame)
    assert pb.SubscribeKvEventsResponse.FromString(wire) == frame_pb(frame)
    assert frame_bytes(frame) == wire == frame_pb(frame).SerializeToString()
