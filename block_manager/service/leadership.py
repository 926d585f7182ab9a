"""Active/standby: which of several block managers on one PostgreSQL database serves.

Leadership is the store's PostgreSQL advisory lock, held by the session of the store's writer
connection (`block_manager.store.locks`); every journal write goes through that session.
Why a lock and not a lease row: the lock and the only connection allowed to write are one
thing, so a term ends exactly when its session ends and no later commit of the old leader is
possible — there is no second clock (a row's deadline) to compare and no window between "my
lease expired" and "my commit landed". What a lease row adds — ending the term of a leader
that is alive but stuck — comes from the server ending a silent session:
`idle_session_timeout` / `idle_in_transaction_session_timeout` = the lease (`StoreOptions.
leader_lease_s`). A healthy leader pings every lease/4; a paused (SIGSTOP), partitioned or
wedged one is disconnected after one lease, its lock released, and a standby takes over.

Fencing, in order of what happens to a leader paused past its lease:
1. the server ends its session: the lock is released and every statement it sends later fails,
   so it cannot commit, hence cannot acknowledge a mutation (acknowledgement follows commit);
2. on waking, before it answers anything, `SqlStore.leadership_fresh()` is False (its last
   successful statement is older than 0.8 x the lease), so reads are refused too
   (`ServiceRuntime.fence`);
3. its keepalive fails, the runtime turns "failed" and the process exits (code 3); the
   orchestrator restarts it, as a standby.
A standby cannot acquire the lock before step 1, and everything the old leader acknowledged
was committed before it, so the new leader recovers every acknowledged mutation; the request
ids journaled with them make a client's resend of an unanswered one return the recorded result.

A standby answers health NOT_SERVING (and every RPC UNAVAILABLE "block manager is standby"),
follows the journal into a warm copy of the state (service/follower.py) and retries the lock;
on success it bumps the leadership epoch (in the database, under the lock), replays what it
had not followed yet, and serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from block_manager.store import SchemaVersionError, StoreError, StoreLocked
from block_manager.store.base import Store, StoreStats
from block_manager.store.records import JournalRecord, NewRecord, Recovered, RetainedRequest
from pagedkv.logging import get_logger

log = get_logger(__name__)

S = TypeVar("S", bound=Store)   # the kind of store `acquire` opens


class NotLeading:
    """The store of a standby: it holds nothing, and says so to anything that asks."""

    backend = "standby"

    @property
    def last_seq_no(self) -> int:
        return 0

    def _refuse(self) -> StoreError:
        return StoreError("this block manager is a standby: it does not hold the store")

    def recover(self) -> Recovered:
        raise self._refuse()

    def append(self, records: Sequence[NewRecord]) -> list[int]:
        raise self._refuse()

    def write_snapshot(self, seq_no: int, state: dict) -> None:
        raise self._refuse()

    def lookup_request(self, request_id: str) -> JournalRecord | None:
        raise self._refuse()

    def retained_requests(self) -> list[RetainedRequest]:
        raise self._refuse()

    def records_after(self, seq_no: int, limit: int = 1000) -> list[JournalRecord]:
        raise self._refuse()

    def stats(self) -> StoreStats:
        return StoreStats("standby", 0, 0, 0)

    def close(self) -> None:
        return None


async def acquire(open_store: Callable[[], S], stopped: asyncio.Event) -> S | None:
    """Open (= lock) the store, retrying while another block manager holds it; None when
    `stopped` is set first. Each attempt waits up to the store's `lock_wait_s` on one session
    (polling the lock every 50 ms), so a released lock is taken within ~50 ms."""
    attempts = 0
    while not stopped.is_set():
        try:
            return await asyncio.to_thread(open_store)
        except StoreLocked:
            attempts += 1
            if attempts == 1:
                log.info("standby: another block manager leads; waiting for its lock")
        except SchemaVersionError:
            raise  # needs an operator (db upgrade / --migrate), not patience
        except StoreError as exc:  # database unreachable: keep trying, a standby has time
            log.warning("standby: cannot reach the store", error=str(exc).splitlines()[0][:300])
            try:
                await asyncio.wait_for(stopped.wait(), 1.0)
            except TimeoutError:
                pass
    return None


__all__ = ["NotLeading", "acquire"]
