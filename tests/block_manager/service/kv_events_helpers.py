"""Helpers of the KV events tests: a subscriber task over a real gRPC stream, the view the
block manager's prefix indexes say it must have, and a Step driver with swaps and failures."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc

from block_manager.client.kv_events import TIER_NAMES, KvView
from block_manager.service.kv_events import salt_id
from block_manager.service.server import BlockManagerServer
from pagedkv.v1 import block_manager_pb2 as pb
from tests.block_manager.service.service_helpers import Harness, step_request
from tests.support.polling import eventually


class Subscriber:
    """Reads one SubscribeKvEvents stream into a `KvView` (kept across reconnects)."""

    def __init__(self) -> None:
        self.view = KvView()
        self.task: asyncio.Task[None] | None = None
        self.call: Any = None
        self.ended: grpc.StatusCode | None = None
        self.error: BaseException | None = None
        self.first_ids: list[int] = []     # the first event id of each connection
        self.kinds: Counter[tuple[str, str]] = Counter()   # (kind, tier) of the live events read

    def start(self, stub: Any, *, from_event_id: int | None = None, metadata: Any = ()) -> None:
        start_id = self.view.last_event_id if from_event_id is None else from_event_id
        self.ended = None
        self.call = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(from_event_id=start_id), metadata=metadata)
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        first = True
        try:
            async for resp in self.call:
                for ev in resp.events:
                    if first:
                        self.first_ids.append(ev.event_id)
                        first = False
                    self.view.apply(ev)
                    kind = ev.WhichOneof("kind")
                    if not self.view.in_snapshot and kind in ("block_stored", "block_removed", "all_blocks_cleared"):
                        self.kinds[(kind, TIER_NAMES[getattr(ev, kind).tier])] += 1
        except grpc.aio.AioRpcError as exc:
            self.ended = exc.code()
        except asyncio.CancelledError:
            self.ended = grpc.StatusCode.CANCELLED    # stop(): our own cancel
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test's checks
            self.error = exc

    async def stop(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.task is not None:
            await asyncio.wait([self.task])

    async def caught_up(self, server: BlockManagerServer, timeout_s: float = 20.0) -> None:
        hub = server.runtime.kv_events  # type: ignore[union-attr]

        def done() -> bool:
            if self.error is not None:
                raise AssertionError(f"subscriber failed: {self.error!r}")
            return self.view.ready and self.view.last_event_id == hub.head

        await eventually(done, timeout_s=timeout_s, interval_s=0.005, what="subscriber caught up with the head")


def expected_view(server: BlockManagerServer) -> dict:
    """The block manager's prefix indexes, keyed and valued as the events describe them."""
    core = server.runtime.state.core  # type: ignore[union-attr]
    return {key: {h: (parent, salt_id(salt), n) for h, (parent, salt, n) in entries.items()}
            for key, entries in core.kv_index_view().items()}


async def step(h: Harness, *, swap_out: list[str] = (), swap_in: list[str] = (),  # type: ignore[assignment]
               fail: str | None = None, place: list[str] | None = None, **kw: Any) -> pb.StepResponse:
    """One Step carrying the pending reports (the pool `fail` reports its last step failed).
    With `place`, every allocation is placed by the block manager among those pools (their
    pool id is ignored): the placement that plans prefix fetches (docs/prefix_fetch.md)."""
    reports = dict(h.reports)
    if fail is not None and fail in reports:
        epoch, done, _ = reports[fail]
        reports[fail] = (epoch, done - 1, done)
    req = step_request(reports=reports, **kw)
    req.swap_out_seq_ids.extend(swap_out)
    req.swap_in_seq_ids.extend(swap_in)
    if place is not None:
        req.alloc_place.extend([True] * len(req.alloc_seq_ids))
        req.place_pool_ids.extend(place)
    resp = await h.stub.Step(req, timeout=30)
    for pool in reports:
        h.reports.pop(pool, None)
    for ps in resp.steps:
        done = h.reports.get(ps.pool_id, (ps.epoch, 0, 0))[1]
        h.reports[ps.pool_id] = (ps.epoch, max(done, ps.step_id), 0)
    return resp


__all__ = ["Subscriber", "expected_view", "step"]
