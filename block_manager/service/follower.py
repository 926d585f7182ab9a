"""A standby's warm copy of the leader's state, kept by following the journal it cannot write.

While it waits for the lock, the standby polls the journal (`JournalReader`) and applies each
new record through `replay_record` — the code recovery and live RPCs use, client sessions included — so at takeover
it replays only the records committed since its last poll instead of the whole snapshot +
journal (`ServiceRuntime.start(warm=...)`). A gap (records pruned by a snapshot before the
follower read them) or a record that does not apply drops the copy: the next poll reloads from
the latest snapshot, and a takeover without a usable copy recovers from scratch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from block_manager.service.config import BlockManagerConfig
from block_manager.service.replay import replay_record
from block_manager.service.sessions import SessionTable
from block_manager.service.state import ServiceState, StateConfig
from block_manager.store.reader import JournalReader
from block_manager.store.records import JournalRecord
from pagedkv.logging import get_logger

log = get_logger(__name__)

MAX_KEPT_RECORDS = 10_000   # recent records whose results seed the request index at takeover


@dataclass(slots=True)
class WarmState:
    state: ServiceState
    sessions: SessionTable           # the client sessions, followed with the state
    seq_no: int                      # the last record applied
    records: list[JournalRecord]     # the most recent applied records (results for the index)


def _default_sessions() -> SessionTable:
    c = BlockManagerConfig()
    return SessionTable(window_s=c.session_window_s, ttl_s=c.session_ttl_s, max_sessions=c.max_sessions,
                        max_answers=c.max_session_answers)


class JournalFollower:
    def __init__(
        self, reader: JournalReader, config: StateConfig, clock: Callable[[], float],
        new_sessions: Callable[[], SessionTable] | None = None,
    ) -> None:
        """`new_sessions`: an empty session table as the server configures it (default: the
        default limits)."""
        self._reader = reader
        self._config = config
        self._clock = clock
        self._new_sessions = new_sessions or _default_sessions
        self._state: ServiceState | None = None
        self._sessions = self._new_sessions()
        self._seq_no = 0
        self._records: deque[JournalRecord] = deque(maxlen=MAX_KEPT_RECORDS)
        self.num_applied = 0
        self.num_reloads = 0

    @property
    def seq_no(self) -> int:
        return self._seq_no

    def poll(self, max_records: int = 5000) -> int:
        """Apply what was committed since the last poll (blocking: run it in a thread)."""
        if self._state is None:
            self._load()
        if self._state is None:
            return 0
        batch = self._reader.records_after(self._seq_no, max_records)
        if batch and batch[0].seq_no != self._seq_no + 1:
            log.info("follower: journal pruned past our position; reloading", at=self._seq_no, next=batch[0].seq_no)
            self._state = None
            return 0
        if not batch and self._reader.latest_snapshot_seq_no() > self._seq_no:
            # A snapshot pruned every record after our position: nothing to see but the gap.
            log.info("follower: a newer snapshot covers records we never read; reloading", at=self._seq_no)
            self._state = None
            return 0
        now = self._clock()
        for rec in batch:
            try:
                replay_record(self._state, self._sessions, rec, now)
            except Exception as exc:  # noqa: BLE001 - the copy is unusable; recovery will redo it
                log.error("follower: record does not apply; dropping the copy", seq_no=rec.seq_no, error=repr(exc))
                self._state = None
                return 0
            self._seq_no = rec.seq_no
            self._records.append(rec)
        self.num_applied += len(batch)
        return len(batch)

    def _load(self) -> None:
        snap = self._reader.latest_snapshot()
        now = self._clock()
        self._sessions = self._new_sessions()
        if snap is None:
            self._state, self._seq_no = ServiceState(self._config), 0
        else:
            self._seq_no = snap[0]
            self._state = ServiceState.from_snapshot(snap[1], self._config, now)
            self._sessions.load_snapshot(snap[1].get("sessions"), now)
        self._records.clear()
        self.num_reloads += 1

    def warm(self) -> WarmState | None:
        """The copy to take over with (None: recover from scratch). The follower is spent."""
        if self._state is None:
            return None
        warm = WarmState(self._state, self._sessions, self._seq_no, list(self._records))
        self._state = None
        return warm

    def close(self) -> None:
        self._reader.close()


__all__ = ["JournalFollower", "WarmState"]
