"""Durable journal + snapshots for the block manager (SQLite, PostgreSQL, in-memory).

The service journals every mutating RPC as a `NewRecord` (group-committed with `append`),
writes periodic snapshots with `write_snapshot`, answers retried request ids from
`lookup_request`, and on start-up rebuilds its state from `recover()`: the latest snapshot
plus every later record, replayed in seq_no order through the deterministic core; it then
indexes every request id the journal still holds (`retained_requests()`), so a retry of any
of them is answered, never applied a second time.

URLs for `open_store`:
- `sqlite:///path/to/journal.db` (the default deployment): WAL, `synchronous=FULL`, and an
  exclusive `flock` on `journal.db.lock` so one block manager owns the file;
- `postgresql+psycopg://user@host:port/db` (or `postgresql://`): a session-level advisory
  lock held by the writer connection; all writes go through that connection;
- `memory://`: same semantics, no durability (in-memory mode, benchmarks).

Guarantees: `append` is one transaction and durable when it returns (nothing of a failed
batch is stored); `write_snapshot` is atomic and keeps only the latest snapshot; a record a
snapshot covers stays answerable by `lookup_request` while it is within the retention window
(`StoreOptions.request_retention_s`, default 600 s, and the newest
`max_retained_requests`, default 10 000). After any database failure during a write the
store refuses further use (fail-stop): the caller's in-memory state may be ahead of the
journal, and on PostgreSQL the lock may be gone.
"""

from block_manager.store.backends import open_store
from block_manager.store.base import Store, StoreOptions, StoreStats
from block_manager.store.errors import (
    DuplicateRequestId,
    InvalidRecord,
    InvalidSnapshot,
    SchemaOutdated,
    SchemaVersionError,
    StoreError,
    StoreLocked,
)
from block_manager.store.memory import MemoryStore
from block_manager.store.records import (
    Body,
    JournalRecord,
    NewRecord,
    Packed,
    Recovered,
    RetainedRequest,
    canonical_json,
    payload_digest,
)
from block_manager.store.sql import SqlStore

__all__ = [
    "Body",
    "DuplicateRequestId",
    "InvalidRecord",
    "InvalidSnapshot",
    "JournalRecord",
    "MemoryStore",
    "NewRecord",
    "Packed",
    "Recovered",
    "RetainedRequest",
    "SchemaOutdated",
    "SchemaVersionError",
    "SqlStore",
    "Store",
    "StoreError",
    "StoreLocked",
    "StoreOptions",
    "StoreStats",
    "canonical_json",
    "open_store",
    "payload_digest",
]
