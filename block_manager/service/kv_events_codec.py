"""KV event frames (service/kv_events.py) -> `SubscribeKvEventsResponse` messages.

A live event is serialized once, as its `events` entry of the response (tag, length, bytes),
and kept on the event (`Event.encoded`); a live message is those entries joined, written as
bytes (the stream's serializer passes bytes through: `pagedkv.rpc.wrap_unary_stream_handler`).
With N subscribers the encoding cost does not grow N times.
"""

from __future__ import annotations

from block_manager.core.kv_events import REMOVED, STORED
from block_manager.service.kv_events import Event, Frame
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.wire import varint

TIER_PB = {"device": pb.KV_TIER_DEVICE, "host": pb.KV_TIER_HOST, "disk": pb.KV_TIER_DISK,
           None: pb.KV_TIER_UNSPECIFIED}


def event_pb(e: Event) -> pb.KvEvent:
    m = pb.KvEvent(event_id=e.event_id)
    if e.kind == STORED:
        m.block_stored.CopyFrom(pb.BlockStored(
            node_id=e.node_id, tier=TIER_PB[e.tier], block_hashes=e.block_hashes, num_tokens=e.num_tokens,
            salt_id=e.salt_id, parent_hash=e.parent_hash or b""))
    elif e.kind == REMOVED:
        m.block_removed.CopyFrom(pb.BlockRemoved(node_id=e.node_id, tier=TIER_PB[e.tier], block_hashes=e.block_hashes))
    else:
        m.all_blocks_cleared.CopyFrom(pb.AllBlocksCleared(node_id=e.node_id, tier=TIER_PB[e.tier]))
    return m


def event_entry(e: Event) -> bytes:
    """`e` as one serialized `events` entry (field 1, length-delimited), built once."""
    entry = e.encoded
    if entry is None:
        data = event_pb(e).SerializeToString()
        entry = e.encoded = b"\x0a" + varint(len(data)) + data
    return entry


def frame_bytes(frame: Frame) -> bytes:
    """The serialized response of one frame; live events from their cached entries."""
    if frame.kind == "events":
        return b"".join([event_entry(e) for e in frame.events or ()])
    return frame_pb(frame).SerializeToString()


def frame_pb(frame: Frame) -> pb.SubscribeKvEventsResponse:
    if frame.kind == "events":
        return pb.SubscribeKvEventsResponse(events=[event_pb(e) for e in frame.events or ()])
    sid = frame.event_id
    if frame.kind == "resync":
        return pb.SubscribeKvEventsResponse(events=[pb.KvEvent(event_id=sid, resync=pb.KvResync(reason=frame.reason))])
    out = pb.SubscribeKvEventsResponse(events=[
        pb.KvEvent(event_id=sid, block_stored=pb.BlockStored(
            node_id=node, tier=TIER_PB[tier], block_hashes=[h], parent_hash=parent or b"", salt_id=salt,
            num_tokens=n))
        for node, tier, h, parent, salt, n in frame.blocks or ()
    ])
    if frame.kind == "snapshot_end":
        out.events.add(event_id=sid, snapshot_end=pb.KvSnapshotEnd(num_blocks=frame.num_blocks))
    return out


__all__ = ["TIER_PB", "event_entry", "event_pb", "frame_bytes", "frame_pb"]
