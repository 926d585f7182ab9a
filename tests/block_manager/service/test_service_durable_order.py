"""No answer leaves the block manager before the state it describes is durable.

The store here is a real `MemoryStore` behind a gate: once armed, `append` (run on the journal
writer's thread, as a SQL store's would be) blocks until the test releases it — a commit whose
fsync takes as long as the test wants. While it is held:

- the request whose record is in that transaction gets no answer;
- a request applied meanwhile (queued for the next transaction) gets no answer either: its
  record can only commit after the held one, so answering it would acknowledge a state built
  on a record that is not durable;
- a refusal that reads the not-yet-durable state (an Allocate of a sequence id the held
  request created) is not answered either — after a crash that sequence would not exist.

After release every answer arrives, each the one a durable server would give.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from block_manager.service.journal_writer import GIL_SWITCH_INTERVAL_S, JournalWriter
from block_manager.service.server import BlockManagerServer
from block_manager.store import MemoryStore, NewRecord, StoreOptions, open_store
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import (
    Harness,
    eventually,
    item_errors,
    service_config,
    step_request,
)

HOLD_S = 0.3   # how long an answer must stay away while the commit is held


class GatedStore:
    """A memory store whose appends block while the gate is armed and not yet released.

    Not a `MemoryStore` subclass on purpose: the journal writer appends to a memory store
    inline on the event loop, and to any other store on its writer thread, like SQL stores.
    """

    def __init__(self) -> None:
        self._inner = MemoryStore(StoreOptions())
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.num_appends = 0

    @property
    def last_seq_no(self) -> int:
        return self._inner.last_seq_no

    def append(self, records: Sequence[NewRecord]) -> list[int]:
        if self.armed:
            self.entered.set()
            if not self.release.wait(timeout=30):
                raise TimeoutError("the test never released the held commit")
        self.num_appends += 1
        return self._inner.append(records)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.fixture
async def gated() -> AsyncIterator[tuple[GatedStore, Harness]]:
    store = GatedStore()
    server = BlockManagerServer(service_config(), store=store)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h = Harness(server, channel, pb_grpc.BlockManagerStub(channel), pb_grpc.BlockManagerAdminStub(channel))
    try:
        yield store, h
    finally:
        store.release.set()
        await channel.close()
        await server.stop(0)


async def _held(store: GatedStore) -> None:
    """Wait (off the loop) until a commit is blocked in the store."""
    if not await asyncio.to_thread(store.entered.wait, 10):
        raise AssertionError("no commit reached the store")


async def test_no_answer_before_its_commit_is_durable(gated: tuple[GatedStore, Harness]) -> None:
    store, h = gated
    await h.register("n1")
    store.armed = True
    first = asyncio.create_task(h.allocate("a", num_tokens=5))
    await _held(store)
    assert h.table("a"), "the op is applied before its commit"
    await asyncio.sleep(HOLD_S)
    assert not first.done(), "answered before its record was durable"
    store.release.set()
    resp = await first
    assert not resp.errors
    assert store.num_appends >= 2   # registration, then the held allocation


async def test_later_requests_wait_for_the_earlier_commit(gated: tuple[GatedStore, Harness]) -> None:
    store, h = gated
    await h.register("n1")
    store.armed = True
    first = asyncio.ensure_future(h.stub.Step(_alloc("a", 5)))
    await _held(store)
    # Applied while the first commit is held: queued for the next transaction.
    second = asyncio.ensure_future(h.stub.Step(_alloc("b", 3)))
    # Refused because of state the held commit created: must not leave before it is durable.
    refused = asyncio.ensure_future(h.stub.Step(_alloc("a", 7)))

    async def second_applied() -> bool:
        return h.server.runtime.state.core.has_sequence("b")

    await eventually(second_applied)
    await asyncio.sleep(HOLD_S)
    assert not first.done() and not second.done(), "answered before the held commit was durable"
    assert not refused.done(), "a refusal that reads non-durable state left before that state was durable"
    store.release.set()
    assert not (await first).errors
    assert not (await second).errors
    errors = item_errors(await refused, "alloc")
    assert errors[0].code == grpc.StatusCode.ALREADY_EXISTS.value[0], errors


def _alloc(seq_id: str, num_tokens: int) -> pb.StepRequest:
    return step_request(allocs=[(seq_id, "n1", None, num_tokens, None, 0)])


async def test_gil_switch_interval_lowered_while_a_writer_thread_runs(tmp_path: Path) -> None:
    """The journal thread must get the GIL back promptly after its fsync (see
    `journal_writer.GIL_SWITCH_INTERVAL_S`); the process's setting is restored when the last
    writer closes, not when the first of two does."""
    before = sys.getswitchinterval()
    writers = [
        JournalWriter(
            open_store(f"sqlite:///{tmp_path / f'{i}.db'}"),
            snapshot_fn=dict, snapshot_interval_s=60.0, snapshot_every_records=100, on_failure=lambda exc: None,
        )
        for i in range(2)
    ]
    assert sys.getswitchinterval() == min(before, GIL_SWITCH_INTERVAL_S)
    await writers[0].close(final_snapshot=False)
    assert sys.getswitchinterval() == min(before, GIL_SWITCH_INTERVAL_S)
    await writers[1].close(final_snapshot=False)
    assert sys.getswitchinterval() == before
