"""SubscribeKvEvents' protocol through the in-process service and a real socket: resume from a
held id continues exactly; an id no longer held (or never issued) gets Resync + snapshot; a
stalled subscriber is dropped to a Resync without holding up any Step; a server that stops
serving ends the streams with UNAVAILABLE; malformed requests get INVALID_ARGUMENT; who may
subscribe under mutual TLS."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from block_manager.service.kv_events import KvEventHub
from pagedkv.tls import open_channel
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.kv_events_helpers import Subscriber, expected_view, step
from tests.block_manager.service.service_helpers import Harness
from tests.fixtures.certs import DevCerts
from tests.support.polling import eventually

SMALL = {"kv_events": {"history_events": 20, "subscriber_buffer_events": 8}}


async def distinct_allocs(h: Harness, first: int, num: int, pool: str = "n1", length: int = 9) -> None:
    """`num` prompts sharing nothing, freed at once (each: stored blocks, kept cached)."""
    for i in range(first, first + num):
        await step(h, allocs=[(f"d{i}", pool, [1000 + i] * length, 0, None, 0)])
        await step(h, frees=[f"d{i}"])


async def test_resume_from_a_held_id_continues_exactly(start_server: Any) -> None:
    h = await start_server(**SMALL)
    await h.register("n1", num_blocks=64)
    await distinct_allocs(h, 0, 2)
    sub = Subscriber()
    sub.start(h.stub)
    await sub.caught_up(h.server)
    assert sub.view.resync_reasons == ["no view yet"] and sub.view.blocks == expected_view(h.server)
    await sub.stop()
    last = sub.view.last_event_id
    await distinct_allocs(h, 10, 3)         # 3 events: well inside the history of 20
    sub.start(h.stub)
    await sub.caught_up(h.server)
    assert sub.view.num_resyncs == 1 and sub.first_ids[-1] == last + 1
    assert sub.view.blocks == expected_view(h.server)
    await sub.stop()
    # resuming at the head: nothing to send until the next event, which follows at once
    head = h.server.runtime.kv_events.head
    sub.start(h.stub)
    await distinct_allocs(h, 20, 1)
    await sub.caught_up(h.server)
    assert sub.view.num_resyncs == 1 and sub.first_ids[-1] == head + 1
    await sub.stop()


async def test_an_id_not_held_gets_resync_and_snapshot(start_server: Any) -> None:
    h = await start_server(**SMALL)
    await h.register("n1", num_blocks=64)
    sub = Subscriber()
    sub.start(h.stub)
    await distinct_allocs(h, 0, 2)
    await sub.caught_up(h.server)
    await sub.stop()
    old = sub.view.last_event_id
    await distinct_allocs(h, 10, 25)       # more events than the history holds
    hub = h.server.runtime.kv_events
    assert hub.history[0].event_id > old + 1
    sub.start(h.stub)
    await sub.caught_up(h.server)
    assert sub.view.resync_reasons == ["no view yet", f"event {old} is not held"]
    assert sub.first_ids[-1] == hub.head   # the Resync carries the id the snapshot is as of
    assert sub.view.blocks == expected_view(h.server) and sub.view.blocks
    await sub.stop()
    # an id never issued (from the future) is not trusted either
    sub.start(h.stub, from_event_id=hub.head + 1000)
    await eventually(lambda: sub.view.num_resyncs == 3, what="a third resync")
    await sub.caught_up(h.server)
    assert sub.view.resync_reasons[-1] == f"event {hub.head + 1000} is not held"
    assert sub.view.blocks == expected_view(h.server)
    await sub.stop()


async def test_live_only_sends_no_snapshot(start_server: Any) -> None:
    h = await start_server()
    await h.register("n1", num_blocks=64)
    await distinct_allocs(h, 0, 2)
    call = h.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(live_only=True))
    hub = h.server.runtime.kv_events
    await eventually(lambda: hub.subscribers, what="the subscription reached the server")   # live only: from then on
    await distinct_allocs(h, 5, 1)
    first = (await call.read()).events[0]
    assert first.WhichOneof("kind") == "block_stored" and first.event_id == hub.head
    assert list(first.block_stored.block_hashes) and first.block_stored.num_tokens == 8
    call.cancel()


async def test_a_stalled_subscriber_is_dropped_to_resync_and_steps_go_on(start_server: Any) -> None:
    h = await start_server(**SMALL)
    await h.register("n1", num_blocks=2048)
    hub: KvEventHub = h.server.runtime.kv_events
    # A subscriber that stops reading: its own channel, without BDP probing (a 64 KiB window),
    # so the server's writes to it block once the window is full.
    stalled_channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}", options=[("grpc.http2.bdp_probe", 0)])
    stalled = stalled_channel.unary_stream(
        "/pagedkv.v1.BlockManager/SubscribeKvEvents",
        request_serializer=pb.SubscribeKvEventsRequest.SerializeToString,
        response_deserializer=pb.SubscribeKvEventsResponse.FromString,
    )(pb.SubscribeKvEventsRequest())
    reading = Subscriber()
    reading.start(h.stub)
    try:
        assert (await stalled.read()).events[0].WhichOneof("kind") == "resync"
        n = 0
        while not any(sub.num_overflows for sub in hub.subscribers) and n < 200:
            # 1000-token prompts: a BlockStored of 250 hashes (~8 KiB), then their eviction
            await step(h, allocs=[(f"big{n}", "n1", [n + 1] + [5] * 999, 0, None, 0)])
            await step(h, frees=[f"big{n}"])
            n += 1
            for sub in hub.subscribers:    # the Step path never lets a queue grow past its bound
                assert sub.num_queued <= sub.capacity
            if n % 20 == 0:
                await reading.caught_up(h.server)
        assert any(sub.num_overflows for sub in hub.subscribers), "the stalled subscriber was never dropped"
        await reading.caught_up(h.server)
        assert reading.view.blocks == expected_view(h.server) and reading.view.num_resyncs == 1
        # reading again, the stalled subscriber gets a Resync and a snapshot, then live events
        reasons: list[str] = []
        while "subscriber buffer overflow" not in reasons:
            resp = await stalled.read()
            assert resp is not grpc.aio.EOF
            reasons += [ev.resync.reason for ev in resp.events if ev.WhichOneof("kind") == "resync"]
        metrics = h.server.metrics.render().decode()
        assert "pagedkv_kv_event_overflows_total 1.0" in metrics and "pagedkv_kv_event_subscribers 2.0" in metrics
    finally:
        stalled.cancel()
        await stalled_channel.close()
        await reading.stop()


async def test_a_server_that_stops_serving_ends_the_streams_unavailable(start_server: Any) -> None:
    h = await start_server()
    await h.register("n1", num_blocks=16)
    sub = Subscriber()
    sub.start(h.stub)
    await sub.caught_up(h.server)
    h.server.runtime.begin_drain()
    await eventually(lambda: sub.ended is not None, what="the stream ended")
    assert sub.ended == grpc.StatusCode.UNAVAILABLE
    call = h.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (err.value.details() or "")


async def test_malformed_requests_are_invalid_argument(start_server: Any) -> None:
    h = await start_server()
    raw = h.channel.unary_stream("/pagedkv.v1.BlockManager/SubscribeKvEvents", request_serializer=None,
                                 response_deserializer=None)
    for payload in (b"\xff\xff\xff", b"\x08", b"\x0a\x05abc"):
        call = raw(payload, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, payload
    assert await h.fsck() == []


async def test_only_subscribers_and_admins_may_subscribe_under_mutual_tls(
    start_server: Any, dev_certs: DevCerts
) -> None:
    h = await start_server(tls=dev_certs.server("block-manager"))

    async def first_kind(name: str) -> Any:
        channel = open_channel(f"127.0.0.1:{h.server.port}", dev_certs.client(name), aio=True)
        try:
            call = pb_grpc.BlockManagerStub(channel).SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=10)
            try:
                return (await call.read()).events[0].WhichOneof("kind")
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        finally:
            await channel.close()

    assert await first_kind("subscriber") == "resync"
    assert await first_kind("admin") == "resync"
    assert await first_kind("scheduler") == grpc.StatusCode.PERMISSION_DENIED
    assert await first_kind("compute-node-0") == grpc.StatusCode.PERMISSION_DENIED
    # ... and a subscriber's certificate reaches nothing else
    channel = open_channel(f"127.0.0.1:{h.server.port}", dev_certs.client("subscriber"), aio=True)
    try:
        for call in (pb_grpc.BlockManagerStub(channel).Route(pb.RouteRequest(token_ids=[1]), timeout=10),
                     pb_grpc.BlockManagerAdminStub(channel).Status(pb.StatusRequest(), timeout=10)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await channel.close()


async def test_a_subscriber_that_goes_away_mid_write_is_forgotten(start_server: Any, caplog: Any) -> None:
    """The server's write to a stalled stream is blocked when its subscriber cancels: the
    subscription is dropped (the hub offers it nothing more) and gRPC logs no servicer error."""
    h = await start_server(**SMALL)
    await h.register("n1", num_blocks=2048)
    hub: KvEventHub = h.server.runtime.kv_events
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}", options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.BlockManagerStub(channel).SubscribeKvEvents(pb.SubscribeKvEventsRequest())
    try:
        assert (await call.read()).events[0].WhichOneof("kind") == "resync"
        n = 0
        while not any(sub.num_overflows for sub in hub.subscribers) and n < 200:
            await step(h, allocs=[(f"big{n}", "n1", [n + 1] + [5] * 999, 0, None, 0)])
            await step(h, frees=[f"big{n}"])
            n += 1
        assert hub.subscribers and any(sub.num_overflows for sub in hub.subscribers)
        call.cancel()
        await eventually(lambda: not hub.subscribers, what="the subscription dropped")
    finally:
        await channel.close()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, [r.getMessage() for r in errors]


async def test_kv_events_off_records_nothing_and_refuses_subscribers(start_server: Any) -> None:
    h = await start_server(kv_events={"enabled": False})
    await h.register("n1", num_blocks=64)
    await distinct_allocs(h, 0, 2)
    assert h.server.runtime.state.core.take_kv_changes() == [] and h.server.runtime.kv_events.num_published == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await h.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=10).read()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_events.enabled" in (err.value.details() or "")
