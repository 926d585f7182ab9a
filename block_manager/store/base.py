"""The `Store` protocol and the options every backend understands.

A store is the block manager's durable memory: an append-only journal of mutations (one
record per mutating RPC, written in one transaction per group commit) plus the latest
snapshot of the service state. Recovery is "snapshot + replay every later record through
the deterministic core". Exactly one block manager may write a database at a time, so every
backend takes a single-writer lock when it opens and holds it until `close()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from block_manager.store.errors import StoreError
from block_manager.store.records import JournalRecord, NewRecord, Recovered, RetainedRequest


@dataclass(slots=True, frozen=True)
class StoreOptions:
    """Tuning knobs shared by all backends.

    Request-id window: a journal record is always kept while no snapshot covers it. Once a
    snapshot covers it, it is kept (so `lookup_request` still answers a retry) while it is
    among the newest `max_retained_requests` records AND younger than
    `request_retention_s`; the next snapshot prunes it after that. So a retry that arrives
    within `request_retention_s` of the original and within `max_retained_requests`
    later mutations is always answered from the record. Bounding both keeps the journal
    small when AppendSlots batches of hundreds of sequences arrive every few milliseconds.
    """

    request_retention_s: float = 600.0
    max_retained_requests: int = 10_000
    # SQLite only: "FULL" fsyncs the WAL on every commit (durable against power loss);
    # "NORMAL" only on checkpoints (durable against a process crash only). See sqlite.py.
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    sqlite_busy_timeout_ms: int = 5_000
    # How long `open_store` waits for another writer to release the lock before
    # raising `StoreLocked` (0: fail at once). A restarting manager whose predecessor was
    # just killed may need a moment until the database notices the dead session.
    lock_wait_s: float = 0.0
    snapshot_compress_level: int = 1
    # SQL stores: upgrade an older schema at open (`serve --migrate`); without it an older
    # schema is refused with `SchemaOutdated`, which names the command to run.
    migrate: bool = False
    # PostgreSQL active/standby: the leader's lease. The lock-holding session is terminated
    # by the server after this long without a statement (idle_session_timeout and
    # idle_in_transaction_session_timeout), which releases the advisory lock for a standby;
    # the store pings every lease/4 while it is healthy. None: no lease (single server).
    leader_lease_s: float | None = None
    # Who holds the lock (logged in the leadership row): host and pid by default.
    holder: str = ""
    clock: Callable[[], float] = field(default=time.time)

    def __post_init__(self) -> None:
        if self.request_retention_s < 0 or self.max_retained_requests < 0:
            raise StoreError("request_retention_s and max_retained_requests must be >= 0")
        if self.sqlite_synchronous not in ("FULL", "NORMAL"):
            raise StoreError(
                f"sqlite_synchronous must be FULL or NORMAL, not {self.sqlite_synchronous!r}"
            )
        if self.sqlite_busy_timeout_ms < 0 or self.lock_wait_s < 0:
            raise StoreError("sqlite_busy_timeout_ms and lock_wait_s must be >= 0")
        if self.leader_lease_s is not None and self.leader_lease_s < 0.2:
            raise StoreError("leader_lease_s must be >= 0.2 s")
        if not -1 <= self.snapshot_compress_level <= 9:
            raise StoreError("snapshot_compress_level must be in -1..9 (zlib)")


@dataclass(slots=True, frozen=True)
class StoreStats:
    backend: str
    last_seq_no: int
    snapshot_seq_no: int
    num_journal_records: int


@runtime_checkable
class Store(Protocol):
    """The contract between the block manager service and its persistence.

    All methods are synchronous and thread-safe; the service calls them from a writer
    thread (or `asyncio.to_thread`) so the event loop never blocks on I/O.
    """

    backend: str  # "memory", "sqlite" or "postgresql"

    @property
    def last_seq_no(self) -> int:
        """Highest seq_no assigned so far (0 for an empty store)."""
        ...

    def recover(self) -> Recovered:
        """Latest snapshot (or None) and every later record, in seq_no order."""
        ...

    def append(self, records: Sequence[NewRecord]) -> list[int]:
        """Journal a batch in ONE transaction; durable when it returns.

        Returns the assigned seq_nos (strictly increasing, in batch order). On any error
        nothing of the batch is stored.
        """
        ...

    def write_snapshot(self, seq_no: int, state: dict) -> None:
        """Atomically store `state` as of `seq_no` and prune what it makes redundant."""
        ...

    def lookup_request(self, request_id: str) -> JournalRecord | None:
        """The journaled record of `request_id`, if still within the retention window."""
        ...

    def retained_requests(self) -> list[RetainedRequest]:
        """Every request id the journal holds, in seq_no order (ids and digests only).

        The service loads these at start-up: a retry of any of them must be answered from the
        journal, never applied a second time (the journal's unique request id would refuse
        the second record, and the in-memory state would already hold the change).
        """
        ...

    def records_after(self, seq_no: int, limit: int = 1000) -> list[JournalRecord]:
        """Up to `limit` retained records with seq_no > `seq_no`, in order.

        For followers of the journal (the KV event stream). Records pruned by a snapshot
        are gone: a caller that sees its next seq_no missing must resync from state.
        """
        ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None:
        """Release the writer lock and connections; idempotent."""
        ...


def prune_bounds(
    snapshot_seq_no: int, last_seq_no: int, now: float, options: StoreOptions
) -> tuple[int, int, float]:
    """Return `(max_covered, max_by_count, min_created_at)`: a record is pruned when
    `seq_no <= max_covered and (seq_no <= max_by_count or created_at < min_created_at)`."""
    return (
        snapshot_seq_no,
        last_seq_no - options.max_retained_requests,
        now - options.request_retention_s,
    )
