"""Group commit: concurrent RPCs' journal records go to the store in one transaction.

RPC handlers apply their mutation to the in-memory state on the event loop (which
serialises them), then `await writer.commit(record)`. A single flusher task drains
everything queued since the previous transaction into the next `store.append` call, run on
one dedicated thread so the event loop never blocks on I/O. While a transaction is in
flight, new records pile up and share the next one — the batch grows with load, which is
what keeps durable throughput close to in-memory throughput.

Records are committed in the order they were applied, so the journal order is the order
of state changes and replay reproduces it. If a transaction fails, the state already holds
changes the journal lacks: every waiter gets `JournalFailure` and `on_failure` is called so
the server stops serving (fail-stop) instead of acknowledging what it could lose. Refusals a
request's own content could cause are ruled out before its op is applied (see
`ServiceRuntime`), so a failed transaction here is a store failure — or a bug, which is
logged as such (`journal refused a validated record`) and handled the same way.

An answer that is not itself journaled can still depend on state that is: a Step refused
because a sequence exists, when the Allocate that created it is applied but its transaction
is still being fsynced. If the server crashed before that fsync, the refusal would describe a
state that never became durable. `barrier()` waits until every record queued so far is
committed, and the runtime awaits it before such an answer leaves (see
`ServiceRuntime.mutate`); it costs nothing when no transaction is in flight.

Snapshots are written by the flusher too, at a moment when nothing is queued or in
flight, so the state it serialises corresponds exactly to the last committed seq_no. Under
continuous load the queue may never be empty; once a snapshot is overdue (twice its
record or time budget) the writer closes a gate that `ServiceRuntime.mutate` waits on
before applying, drains the queue, snapshots and reopens the gate — a short pause instead
of an ever-growing replay.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from block_manager.service.errors import JournalFailure
from block_manager.store import DuplicateRequestId, InvalidRecord, MemoryStore, NewRecord, Store
from pagedkv.logging import get_logger

log = get_logger(__name__)

# The process's GIL switch interval while a journal thread runs (see `JournalWriter`).
GIL_SWITCH_INTERVAL_S = 0.0005


class _SwitchInterval:
    """Lowers the process's GIL switch interval while any journal writer thread exists and
    restores the previous one when the last is closed (tests run several servers at once)."""

    def __init__(self) -> None:
        self._num_holders = 0
        self._previous: float | None = None

    def hold(self) -> None:
        if self._num_holders == 0 and sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            self._previous = sys.getswitchinterval()
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._num_holders += 1

    def release(self) -> None:
        self._num_holders -= 1
        if self._num_holders == 0 and self._previous is not None:
            sys.setswitchinterval(self._previous)
            self._previous = None


_SWITCH_INTERVAL = _SwitchInterval()


class JournalWriter:
    def __init__(
        self,
        store: Store,
        *,
        snapshot_fn: Callable[[], dict[str, Any]],
        snapshot_interval_s: float,
        snapshot_every_records: int,
        on_failure: Callable[[BaseException], None],
        on_commit: Callable[[int, int], None] | None = None,
        on_snapshot: Callable[[int], None] | None = None,
        journal: bool = True,
    ) -> None:
        self.store = store
        # journal=False (a server opened on "memory://"): nothing survives the process
        # anyway, so records are only numbered, never encoded or stored.
        self.journal = journal
        self._snapshot_fn = snapshot_fn
        self._snapshot_interval_s = snapshot_interval_s
        self._snapshot_every_records = snapshot_every_records
        self._on_failure = on_failure
        self._on_commit = on_commit
        self._on_snapshot = on_snapshot
        # The memory store does no I/O: appending inline avoids a thread hop per batch.
        self._inline = isinstance(store, MemoryStore)
        self._executor = None if self._inline else ThreadPoolExecutor(1, thread_name_prefix="journal")
        self._holds_switch_interval = False
        if self._executor is not None:
            # The writer thread drops the GIL for each SQL call (the fsync is in COMMIT) and
            # must take it back from a busy event loop to hand the results over; with the
            # default 5 ms interval that wait, not the fsync, dominated a commit under load.
            _SWITCH_INTERVAL.hold()
            self._holds_switch_interval = True
        self._pending: list[tuple[NewRecord, asyncio.Future[int]]] = []
        # The newest queued record's future: done once everything applied so far is durable.
        self._newest: asyncio.Future[int] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self.last_seq_no = store.last_seq_no
        self.snapshot_seq_no = 0
        self._records_since_snapshot = 0
        self._last_snapshot_at = time.monotonic()
        self._gate = asyncio.Event()
        self._gate.set()
        self.num_transactions = 0
        self.num_records = 0

    @property
    def failed(self) -> bool:
        return self._failed is not None

    @property
    def gate_open(self) -> bool:
        return self._gate.is_set()

    async def wait_gate(self) -> None:
        """Wait while an overdue snapshot drains the queue (see the module docstring)."""
        await self._gate.wait()

    async def commit(self, record: NewRecord, on_done: Callable[[asyncio.Future[int]], None] | None = None) -> int:
        """Queue `record`; returns its seq_no once the transaction holding it committed.
        `on_done(future)` runs when the transaction is decided, even if the caller was
        cancelled meanwhile (the record is committed all the same)."""
        if self._failed is not None:
            raise JournalFailure("the journal failed earlier; the server is stopping")
        if not self.journal:
            self.last_seq_no += 1
            self.num_records += 1
            self.num_transactions += 1
            return self.last_seq_no
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if on_done is not None:
            fut.add_done_callback(on_done)
        self._pending.append((record, fut))
        self._newest = fut
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="journal-flusher")
        return await asyncio.shield(fut)

    async def barrier(self) -> None:
        """Wait until every record queued so far is committed: an answer that reads state
        those records changed may then leave. `JournalFailure` if their transaction failed
        (the state the answer saw may be lost)."""
        newest = self._newest
        if newest is None or not self.journal:
            return
        if not newest.done():
            await asyncio.shield(newest)
        elif newest.exception() is not None:
            raise JournalFailure("the journal failed earlier; the server is stopping")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _flush_loop(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                seq_nos = await self._run(self.store.append, [r for r, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - any store failure is fatal for the journal
                self._fail(exc, batch)
                return
            self.num_transactions += 1
            self.num_records += len(batch)
            for (_, fut), seq_no in zip(batch, seq_nos, strict=True):
                if not fut.done():
                    fut.set_result(seq_no)
            self.last_seq_no = seq_nos[-1]
            self._records_since_snapshot += len(batch)
            if self._on_commit is not None:
                self._on_commit(len(batch), self.last_seq_no)
            if self._snapshot_due():
                if not self._pending:
                    await self.snapshot()
                    self._gate.set()
                elif self._snapshot_overdue():
                    self._gate.clear()
        self._gate.set()

    def _fail(self, exc: BaseException, batch: list[tuple[NewRecord, asyncio.Future[int]]]) -> None:
        self._failed = exc
        if isinstance(exc, (InvalidRecord, DuplicateRequestId)):
            # The runtime validates records before applying them: reaching this is a bug.
            log.error("journal refused a validated record; stopping", error=repr(exc), num_records=len(batch))
        else:
            log.error("journal append failed; stopping", error=repr(exc), num_records=len(batch))
        waiters = batch + self._pending
        self._pending = []
        self._gate.set()  # waiters at the gate get JournalFailure from commit()
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(JournalFailure("journal write failed"))
        self._on_failure(exc)

    def _snapshot_due(self) -> bool:
        return self._records_since_snapshot >= self._snapshot_every_records or (
            self._records_since_snapshot > 0 and time.monotonic() - self._last_snapshot_at >= self._snapshot_interval_s
        )

    def _snapshot_overdue(self) -> bool:
        return self._records_since_snapshot >= 2 * self._snapshot_every_records or (
            time.monotonic() - self._last_snapshot_at >= 2 * self._snapshot_interval_s
        )

    async def snapshot(self) -> None:
        """Write a snapshot of the state as of `last_seq_no` (call with nothing queued)."""
        seq_no = self.last_seq_no
        state = self._snapshot_fn()  # on the loop: consistent with seq_no
        self._records_since_snapshot = 0
        self._last_snapshot_at = time.monotonic()
        try:
            await self._run(self.store.write_snapshot, seq_no, state)
        except Exception as exc:  # noqa: BLE001 - a failed snapshot is retried later
            log.warning("snapshot failed; will retry", error=repr(exc), seq_no=seq_no)
            self._records_since_snapshot = self._snapshot_every_records
            return
        self.snapshot_seq_no = seq_no
        log.info("snapshot written", seq_no=seq_no)
        if self._on_snapshot is not None:
            self._on_snapshot(seq_no)

    async def drain(self) -> None:
        """Wait until everything queued so far is committed (or failed)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def close(self, *, final_snapshot: bool) -> None:
        await self.drain()
        if final_snapshot and self.journal and self._failed is None and self.last_seq_no > self.snapshot_seq_no:
            await self.snapshot()
        await self._run(self.store.close)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._holds_switch_interval:
            self._holds_switch_interval = False
            _SWITCH_INTERVAL.release()


__all__ = ["JournalWriter"]
