"""Store errors.

The service maps these to gRPC codes itself: a `StoreError` while journaling means the
mutation was *not* made durable, so the RPC must fail (INTERNAL) and the in-memory state
must be rebuilt or the process stopped; `StoreLocked` at start-up means another block
manager is active on the same database and this one must not start.
"""

from __future__ import annotations


class StoreError(Exception):
    """Any failure to read or durably write the journal or a snapshot."""


class StoreLocked(StoreError):
    """Another process (or store object) already holds the database's single-writer lock."""


class SchemaVersionError(StoreError):
    """The database was written by a schema version this code does not understand."""


class DuplicateRequestId(StoreError):
    """A record's request id is already journaled (or repeated inside one batch).

    Raised before anything of the batch is visible: the whole `append` is rolled back.
    """


class InvalidRecord(StoreError):
    """A record cannot be journaled (wrong type, empty id, not JSON-serialisable)."""


class InvalidSnapshot(StoreError):
    """`write_snapshot` got a state or seq_no it cannot store (nothing was written)."""


class SchemaOutdated(SchemaVersionError):
    """The database is at an older schema revision than this code needs.

    Nothing was changed: run `block-manager db upgrade` (the message names the exact command)
    or start the server with `--migrate`.
    """

    def __init__(self, current: str, head: str, command: str = "block-manager db upgrade") -> None:
        self.current = current
        self.head = head
        self.command = command
        super().__init__(
            f"database schema is at revision {current}, this block manager needs {head}; "
            f"run `{command}` (or start the server with --migrate)"
        )

    def with_command(self, command: str) -> SchemaOutdated:
        return SchemaOutdated(self.current, self.head, command)
