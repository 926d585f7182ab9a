"""Single-writer locks: one active block manager per database.

SQLite: an exclusive `flock` on `<db>.lock`, held by an open file for the store's lifetime;
the kernel drops it when the process dies (even on SIGKILL), so a crashed manager never
leaves a stale lock behind. `flock` locks belong to the open file description, so a second
store in the *same* process is refused too.

PostgreSQL: a session-level advisory lock taken on the store's writer connection. Writing
through that same connection is what makes the lock a fence: if the session dies the lock is
gone, and so is the only connection that could write.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path

from sqlalchemy import Connection, text

from block_manager.store.errors import StoreError, StoreLocked

# A fixed 64-bit key derived from the project name (advisory locks are keyed by bigint).
PG_ADVISORY_LOCK_KEY = int.from_bytes(
    hashlib.sha256(b"pagedkv.block_manager.store").digest()[:8], "big", signed=True
)
_RETRY_INTERVAL_S = 0.05


class FileLock:
    def __init__(self, path: Path, wait_s: float = 0.0) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot open lock file {path}: {exc}") from exc
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    self._fd = None
                    raise StoreLocked(
                        f"{path} is locked: another block manager is using this database"
                    ) from None
                time.sleep(_RETRY_INTERVAL_S)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def acquire_pg_advisory_lock(conn: Connection, wait_s: float = 0.0) -> None:
    """Take the session-level advisory lock on `conn` or raise `StoreLocked`."""
    deadline = time.monotonic() + wait_s
    stmt = text("SELECT pg_try_advisory_lock(:key)")
    while True:
        with conn.begin():
            got = conn.execute(stmt, {"key": PG_ADVISORY_LOCK_KEY}).scalar_one()
        if got:
            return
        if time.monotonic() >= deadline:
            raise StoreLocked("another block manager holds this PostgreSQL database's lock")
        time.sleep(_RETRY_INTERVAL_S)


def release_pg_advisory_lock(conn: Connection) -> None:
    """Unlock before closing the session: the server drops a closed session's locks only once
    its backend has exited, a moment after the client hung up, and a successor trying the
    lock without waiting (`block-manager db upgrade` right after a stop) would find it held.
    Best effort: a dead session holds nothing anyway."""
    try:
        if conn.in_transaction():
            conn.rollback()
        with conn.begin():
            conn.execute(text("SELECT pg_advisory_unlock_all()"))
    except Exception:  # noqa: BLE001 - the session is gone: so is the lock
        pass
