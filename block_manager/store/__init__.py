"""Durable journal + snapshots for the block manager (SQLite, PostgreSQL, in-memory).

The service journals every mutating RPC as a `NewRecord` (group-committed with `append`),
writes periodic snapshots with `write_snapshot`, answers retried request ids from
`lookup_request`, and on start-up rebuilds its state from `recover()`: the latest snapshot
plus every later record, replayed in seq_no order through the deterministic core.
"""

from block_manager.store.backends import open_store
from block_manager.store.base import Store, StoreOptions, StoreStats
from block_manager.store.errors import (
    DuplicateRequestId,
    InvalidRecord,
    InvalidSnapshot,
    SchemaVersionError,
    StoreError,
    StoreLocked,
)
from block_manager.store.memory import MemoryStore
from block_manager.store.records import (
    JournalRecord,
    NewRecord,
    Recovered,
    canonical_json,
    payload_digest,
)
from block_manager.store.sql import SqlStore

__all__ = [
    "DuplicateRequestId",
    "InvalidRecord",
    "InvalidSnapshot",
    "JournalRecord",
    "MemoryStore",
    "NewRecord",
    "Recovered",
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
