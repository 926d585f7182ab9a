"""The service runtime: state machine + durability + idempotency + lease timer.

`mutate()` is the single entry point of every mutating RPC (and of the server's own
decisions: lease expiry, defrag plans and their timeouts):

1. a request id seen before returns its recorded result (waiting for its commit if it
   is still in flight) — or `RequestIdConflict` when the payload digest differs, or
   `RequestExpired` when the server still knows the id but no longer its result; a request
   in a client session is looked up by its session number instead (`sessions.py`: the
   recorded answer within the session window, else `RequestExpired` — also long after the
   request-id window forgot it, so a late resend is never applied twice);
2. otherwise the op is applied to the in-memory state on the event loop (which
   serialises mutations), journaled through the group-commit writer, and the result is
   returned only after the transaction committed. A refusal, or an answer that changed
   nothing, is not journaled but may read state that is not durable yet: it waits for the
   writer's `barrier()` (every record queued before it committed). No answer leaves before
   the state it describes is durable; meanwhile the next requests are applied and queued,
   so the fsync overlaps their work (group commit).

Ops that fail raise with the state unchanged and record nothing; ops that change nothing
(e.g. an Allocate whose every item failed) are answered but not journaled.

What one request can and cannot do to the process. The state is changed *before* the
journal write, so a record the store refuses after the op was applied leaves the state ahead
of the journal: the writer then stops the server (fail-stop, exit 3), which is right for a
store failure (disk, lost database session) and wrong for a request's own content. So
everything the store could refuse because of one request is settled before `apply`:

- the record's columns (`store.records.check_record_fields`: request id 1..256 characters,
  digest <= 64, no NUL) — else `RecordRejected` (INVALID_ARGUMENT), nothing applied;
- its payload is encoded (`store.records.encode_body`: canonical JSON, or a Step's packed
  request bytes; what the store writes, handed to it as is) — else `RecordRejected`, nothing
  applied;
- its request id is not journaled yet: the request index holds every id the journal holds
  (`RequestIndex`, durable mode), so a retry is answered from the index or the journal,
  never applied again; an id the index still knows whose result is gone everywhere is
  refused with `RequestExpired` (FAILED_PRECONDITION);
- the op's own checks (`ServiceState.apply` validates the whole request before it mutates
  anything, and raises with the state unchanged).

The result is produced by the state machine (ints, strings, lists; a Step's is its packed
response) and always encodes. After
these checks a store refusal can only be the store's fault, and fail-stop stays the answer.
The server's own decisions use ids from `internal_request_id` (a namespace clients cannot
reach); `mutate(..., internal=True)` moves any id it is given into that namespace.

Recovery (`start`) runs off the event loop — the state is not reachable meanwhile,
every RPC gets UNAVAILABLE — and replays the journal through `ServiceState.apply`, the
same code the live RPCs use.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from block_manager.core.errors import PoolLeased
from block_manager.service.config import BlockManagerConfig
from block_manager.service.errors import (
    PredecessorFailed,
    RecordRejected,
    RecoveryError,
    RequestExpired,
    RequestIdConflict,
    ServerUnavailable,
)
from block_manager.service.fleet import FleetService
from block_manager.service.follower import WarmState
from block_manager.service.journal_writer import JournalWriter
from block_manager.service.kv_events import KvEventHub, journal_base, volatile_base
from block_manager.service.replay import apply_op, replay_record
from block_manager.service.request_index import (
    Recorded,
    RequestIndex,
    as_internal_request_id,
    fit_digest,
    internal_request_id,
)
from block_manager.service.sessions import (
    Answer,
    SessionRef,
    SessionTable,
    parse_session_request_id,
    session_request_id,
)
from block_manager.service.state import ServiceState
from block_manager.service.step_codec import ReceivedStep
from block_manager.store import InvalidRecord, NewRecord, Store
from block_manager.store.records import Body, JournalRecord, RetainedRequest, check_record_fields, encode_body
from pagedkv.lifecycle import TaskSet
from pagedkv.logging import get_logger
from pagedkv.rpc import Backoff, clip

log = get_logger(__name__)

Phase = Literal["standby", "recovering", "serving", "draining", "failed", "stopped"]




class ServiceRuntime:
    def __init__(
        self,
        config: BlockManagerConfig,
        store: Store,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        journal: bool = True,
        tasks: TaskSet | None = None,
    ) -> None:
        self.config = config
        self.tasks = tasks or TaskSet("runtime")
        self.store = store
        self.clock = clock
        # Answers of sessioned requests are timed by the wall clock (the journal's
        # created_at uses it too), so the window means the same thing across a restart.
        self.wall_clock = wall_clock
        self.state = ServiceState(config.state_config())
        self.sessions = self.new_sessions()
        self._session_timer: asyncio.TimerHandle | None = None
        self.phase: Phase = "recovering"
        self.started_at = time.monotonic()
        self.num_replayed = 0
        self.recovery_s = 0.0
        self.recovery_problems: list[str] = []
        self._requests = RequestIndex(
            config.max_retained_requests, config.max_retained_result_items, durable=journal
        )
        self._lease_timer: asyncio.TimerHandle | None = None
        # A lease expiry that fails is retried with a growing delay, not at once (the timer
        # would otherwise fire every millisecond while the failure lasts).
        self._expiry_backoff = Backoff(initial_s=0.05, max_s=5.0)
        self._listeners: list[Callable[[str, Body], None]] = []
        self._phase_listeners: list[Callable[[Phase], None]] = []
        self.writer = JournalWriter(
            store,
            snapshot_fn=self._snapshot,
            snapshot_interval_s=config.snapshot_interval_s,
            snapshot_every_records=config.snapshot_every_records,
            on_failure=self._journal_failed,
            on_snapshot=self._after_snapshot,
            journal=journal,
        )
        self.on_applied(self._after_apply)
        # The KV events stream (service/kv_events.py): changes staged at apply, published at commit.
        ev = config.kv_events
        self.kv_events = KvEventHub(ev.history_events, ev.subscriber_buffer_events, ev.batch_interval_s)
        # Active/standby: False once this process can no longer be sure it leads (its
        # database session may have been ended); every RPC is then refused before it is
        # answered. None: a single server, always leading.
        self.fence: Callable[[], bool] | None = None
        self.followed_seq_no = 0   # a standby: the last journal record its warm copy applied
        # Fleet mode (service/fleet.py): members in memory, their pools' leases in the state.
        self.fleet = FleetService(self)
        self.recovered_warm = False   # the last start() took over a followed copy (not a full recovery)

    def new_sessions(self) -> SessionTable:
        c = self.config
        return SessionTable(
            window_s=c.session_window_s, ttl_s=c.session_ttl_s, max_sessions=c.max_sessions,
            max_answers=c.max_session_answers,
        )

    def _snapshot(self) -> dict[str, Any]:
        """The state's snapshot plus the client sessions (an extra key the state ignores)."""
        return {**self.state.to_snapshot(), "sessions": self.sessions.to_snapshot()}

    # ---- lifecycle ------------------------------------------------------------------
    def on_phase(self, listener: Callable[[Phase], None]) -> None:
        self._phase_listeners.append(listener)

    def on_applied(self, listener: Callable[[str, Body], None]) -> None:
        """`listener(op, result)` after every journaled op (defrag runner, timers)."""
        self._listeners.append(listener)

    def _set_phase(self, phase: Phase) -> None:
        if self.phase == phase:
            return
        self.phase = phase
        log.info("phase", phase=phase)
        if phase != "serving":
            self.kv_events.close_all(f"block manager is {phase}")
        for listener in self._phase_listeners:
            listener(phase)

    def wait_as_standby(self) -> None:
        """Before `adopt_store`: refuse every RPC with UNAVAILABLE ("standby")."""
        self._set_phase("standby")

    def adopt_store(self, store: Store) -> None:
        """A standby that took the lead: journal to the store it now holds (then `start`)."""
        self.store = store
        self.writer.store = store
        self.writer.last_seq_no = store.last_seq_no
        self._set_phase("recovering")

    async def start(self, warm: WarmState | None = None) -> None:
        """Recover from the store, then serve. `warm`: a standby's copy of the state, built by
        following the journal (`service/follower.py`): only the records after it are
        replayed; if that fails for any reason, recovery starts from scratch."""
        t0 = time.perf_counter()
        try:
            recovered = None
            self.recovered_warm = False
            if warm is not None:
                try:
                    recovered = await asyncio.to_thread(self._catch_up, warm)
                    self.recovered_warm = True
                except Exception as exc:  # noqa: BLE001 - the full recovery below decides
                    log.warning("warm takeover failed; recovering from the store", error=clip(repr(exc)))
            if recovered is None:
                recovered = await asyncio.to_thread(self._recover)
            state, sessions, records, snapshot_seq_no, problems = recovered
            retained = await asyncio.to_thread(self.store.retained_requests) if self.writer.journal else []
        except Exception as exc:
            self._set_phase("failed")
            raise RecoveryError(f"recovery failed: {exc}") from exc
        self.state = state
        self.sessions = sessions
        self.writer.snapshot_seq_no = snapshot_seq_no
        self.writer.last_seq_no = self.store.last_seq_no
        self._start_kv_events()
        self._index_retained(retained, records)
        if warm is None or self.num_replayed == 0:
            self.num_replayed = len(records)
        self.recovery_s = time.perf_counter() - t0
        self.recovery_problems = problems
        if self.recovery_problems:
            log.error("fsck after recovery found problems", problems=self.recovery_problems[:20])
        log.info("recovered", records=self.num_replayed, snapshot_seq_no=snapshot_seq_no, warm=warm is not None,
                 seconds=round(self.recovery_s, 3))
        self.fleet.reset()   # membership restarts at recovery: members heartbeat again
        self._set_phase("serving")
        self.schedule_lease_check()
        self._arm_session_sweep()

    def _catch_up(self, warm: WarmState) -> tuple[ServiceState, SessionTable, list[JournalRecord], int, list[str]]:
        """A followed state (and its client sessions) + the records committed after it (on a
        worker thread)."""
        state, sessions, seq_no, records = warm.state, warm.sessions, warm.seq_no, list(warm.records)
        now = self.clock()
        num_applied = 0
        while True:
            batch = self.store.records_after(seq_no, 5000)
            if not batch:
                break
            if batch[0].seq_no != seq_no + 1:
                raise RecoveryError(f"the journal was pruned past the followed position {seq_no}")
            for rec in batch:
                replay_record(state, sessions, rec, now)
                seq_no = rec.seq_no
                records.append(rec)
            num_applied += len(batch)
        if seq_no != self.store.last_seq_no:
            raise RecoveryError(f"followed up to {seq_no}, the store is at {self.store.last_seq_no}")
        state.registry.renew_all(now)
        state.leases.renew_all(now)
        sessions.renew_all(now)
        self.num_replayed = num_applied
        return state, sessions, records, self.store.stats().snapshot_seq_no, state.fsck()

    def _index_retained(self, retained: list[RetainedRequest], records: list[JournalRecord]) -> None:
        """Every id the journal holds goes into the request index (with the replayed
        records' results): a retry of any of them must never be applied again."""
        results = {rec.request_id: rec.result for rec in records}
        for r in retained:
            if parse_session_request_id(r.request_id) is not None:
                continue   # answered from the session table
            entry = Recorded(r.payload_digest, results.get(r.request_id), None, r.seq_no)
            self._requests.put(r.request_id, entry)

    def _recover(self) -> tuple[ServiceState, SessionTable, list[JournalRecord], int, list[str]]:
        """Snapshot + replay + fsck, on a worker thread (nothing else touches the state
        while the phase is "recovering"). The client sessions come back too: the snapshot's
        table, then every replayed sessioned record's answer (timed by its `created_at`)."""
        recovered = self.store.recover()
        now = self.clock()
        cfg = self.config.state_config()
        sessions = self.new_sessions()
        if recovered.snapshot is not None:
            state = ServiceState.from_snapshot(recovered.snapshot, cfg, now)
            sessions.load_snapshot(recovered.snapshot.get("sessions"), now)
        else:
            state = ServiceState(cfg)
        for rec in recovered.records:
            replay_record(state, sessions, rec, now)
        state.registry.renew_all(now)
        state.leases.renew_all(now)
        sessions.renew_all(now)
        return state, sessions, recovered.records, recovered.snapshot_seq_no, state.fsck()


    def _start_kv_events(self) -> None:
        """Record the recovered core's prefix-index changes from now on; the hub's head is
        this boot's mark, above every id an earlier process published (service/kv_events.py)."""
        core = self.state.core
        core.take_kv_changes()
        if not self.config.kv_events.enabled:
            return
        core.record_kv_changes()
        base = journal_base(self.store.last_seq_no) if self.writer.journal else volatile_base()
        self.kv_events.reset(base, core.kv_index_view(with_tokens=True))

    def _stage_kv_changes(self) -> list[Any] | None:
        return self.kv_events.stage(self.state.core.take_kv_changes())

    def _kv_on_commit(self, ticket: list[Any] | None) -> Callable[[asyncio.Future[int]], None] | None:
        """Publish an op's staged changes when its record's transaction is decided — not when
        its RPC resumes: a caller cancelled meanwhile (deadline) does not stop the commit."""
        if ticket is None:
            return None
        hub = self.kv_events

        def done(fut: asyncio.Future[int]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                hub.abandon(ticket, "the journal failed")
            else:
                hub.commit(ticket)

        return done

    def begin_drain(self) -> None:
        if self.phase == "serving":
            self._set_phase("draining")

    async def close(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        if self._session_timer is not None:
            self._session_timer.cancel()
        self.fleet.cancel()
        final = self.phase in ("serving", "draining")
        self._set_phase("stopped")
        await self.writer.close(final_snapshot=final)

    def _after_apply(self, op: str, result: Body) -> None:
        if op == "register_node":
            self.schedule_lease_check()
            self.fleet.poke()   # a new pool goes to a member now, not at the next heartbeat

    def _journal_failed(self, exc: BaseException) -> None:
        self._set_phase("failed")

    def fail(self, exc: BaseException) -> None:
        """Stop serving for good (the server exits): the store or the leadership is gone."""
        self._set_phase("failed")

    def _after_snapshot(self, seq_no: int) -> None:
        """The store may now prune records the snapshot covers beyond the newest
        `max_retained_requests` (and older ones by age): forget at most those, so the index
        keeps holding every id the journal holds."""
        self._requests.forget_through(min(seq_no, self.writer.last_seq_no - self.config.max_retained_requests))

    # ---- guards ---------------------------------------------------------------------
    def check_readable(self) -> None:
        if self.phase in ("standby", "recovering", "failed", "stopped"):
            raise ServerUnavailable(f"block manager is {self.phase}")
        self._check_fence()

    def check_writable(self) -> None:
        if self.phase != "serving":
            raise ServerUnavailable(f"block manager is {self.phase}")
        self._check_fence()

    def _check_fence(self) -> None:
        if self.fence is not None and not self.fence():
            raise ServerUnavailable("block manager lost its leadership lease; another one may lead now")

    # ---- mutations ------------------------------------------------------------------
    async def _recorded(self, request_id: str, digest: str) -> Body | None:
        """The recorded result of a known request id (None: never seen, or forgotten by both
        the index and the journal)."""
        rec = self._requests.get(request_id)
        if rec is None:
            return None
        if rec.digest != digest:
            raise RequestIdConflict(f"request id {clip(request_id, 160)!r} was used for a different request")
        if rec.committed is not None:
            await asyncio.shield(rec.committed)
        if rec.result is not None:
            return rec.result
        if self.writer.journal:
            found = await asyncio.to_thread(self.store.lookup_request, request_id)
            if found is not None:
                return found.result
        raise RequestExpired(
            f"request id {clip(request_id, 160)!r} expired: its result is no longer retained; "
            "send the request again with a new id if it is still wanted"
        )

    async def _session_answer(self, session: SessionRef, digest: str) -> Body | None:
        """The recorded answer of a sessioned request (None: a new number); raises when the
        session or the number expired (see `service/sessions.py`)."""
        answer = self.sessions.lookup(session, digest, self.wall_clock(), self.clock())
        if answer is None:
            return None
        if answer.committed is not None:
            await asyncio.shield(answer.committed)
        return answer.result

    async def _known(self, request_id: str, digest: str, session: SessionRef | None) -> Body | None:
        if session is not None:
            return await self._session_answer(session, digest)
        return await self._recorded(request_id, digest)

    async def mutate(
        self, op: str, request_id: str, digest: str, payload: dict[str, Any], *,
        internal: bool = False, session: SessionRef | None = None,
    ) -> dict[str, Any]:
        """Apply + journal one op idempotently (every op but a live Step: `mutate_step`); see
        `_mutate`. Its answer is a dict: a recorded packed answer (a Step's) under the same
        request id means the id was used for a different request."""
        result = await self._mutate(op, request_id, digest, payload, internal=internal, session=session)
        if not isinstance(result, dict):
            raise RequestIdConflict(f"request id {clip(request_id, 160)!r} was used for a different request")
        return result

    async def _mutate(
        self, op: str, request_id: str, digest: str, payload: dict[str, Any] | ReceivedStep, *,
        internal: bool = False, session: SessionRef | None = None, lease_retry: bool = False,
    ) -> Body:
        """Apply + journal one op idempotently; see the module docstring.

        `internal=True` marks the server's own decisions: they run while draining too, and
        `request_id` is moved into the internal namespace (`as_internal_request_id`; ids
        from `internal_request_id` are already there). Digests longer than the journal's
        column are replaced by their sha256 (they are only compared for equality).

        `session`: the request is deduplicated by its session number instead of its request
        id (which then only names it in logs): it is journaled under
        `session_request_id(session, seq)` and its answer is held by the session table for
        the session window, whatever the request-id window does meanwhile. A number pipelined
        after another (`session.after`) is applied only once that one was, and refused when it
        was (`service/sessions.py`, "Pipelining"); a new number's outcome, applied or refused,
        is what releases the numbers pipelined after it (`lease_retry`: a `PoolLeased`
        refusal is not final yet, the caller retries after a lease handover).

        `payload`: the op's journal form, or for a live Step its `ReceivedStep`: decoded
        straight from the message into the state machine's columns, journaled as the request's
        bytes (those its digest was taken over) and answered with the response it records
        (`ReceivedStep.record`: its bytes are the journaled result); replay decodes the same
        bytes with the same decoder.
        """
        if internal:
            self.check_readable()
            request_id = as_internal_request_id(request_id)
        else:
            self.check_writable()
        if session is not None:
            request_id = session_request_id(session.session_id, session.seq)
        digest = fit_digest(digest)
        try:
            check_record_fields(request_id, op, digest)
        except InvalidRecord as exc:
            raise RecordRejected(f"cannot journal this request: {exc}") from None
        recorded = await self._known(request_id, digest, session)
        if recorded is not None:
            return recorded
        if session is None:
            return await self._apply_new(op, request_id, digest, payload, None)
        try:
            if session.after:
                await self._await_predecessor(session)
                recorded = await self._known(request_id, digest, session)   # a resend of it went first
                if recorded is not None:
                    return recorded
            return await self._apply_new(op, request_id, digest, payload, session)
        except PoolLeased:
            if not lease_retry:   # else the caller settles it after its retry
                self.sessions.settle(session, False)
            raise
        except BaseException:
            self.sessions.settle(session, False)   # what is pipelined after it fails too
            raise

    async def _await_predecessor(self, session: SessionRef) -> None:
        """Return once the request this one is pipelined after (`session.after`) was applied;
        `PredecessorFailed` when it was refused or does not arrive within the wait (see
        `service/sessions.py`, "Pipelining")."""
        applied = self.sessions.predecessor(session)
        if applied is None:
            fut = self.sessions.wait_for(session)
            try:
                applied = await asyncio.wait_for(asyncio.shield(fut), self.sessions.pipeline_wait_s)
            except TimeoutError:
                raise PredecessorFailed(
                    f"session {session.session_id!r} number {session.seq}: its predecessor {session.after} did not "
                    f"arrive within {self.sessions.pipeline_wait_s:g} s; not applied"
                ) from None
            finally:
                self.sessions.forget_waiter(session, fut)
        if not applied:
            raise PredecessorFailed(
                f"session {session.session_id!r} number {session.seq}: its predecessor {session.after} failed; "
                "not applied"
            )

    async def _apply_new(
        self, op: str, request_id: str, digest: str, payload: dict[str, Any] | ReceivedStep,
        session: SessionRef | None,
    ) -> Body:
        """Apply a request not seen before, journal it, answer once durable."""
        if not self.writer.journal:
            return self._apply_volatile(op, request_id, digest, payload, session)
        while not self.writer.gate_open:
            await self.writer.wait_gate()
            recorded = await self._known(request_id, digest, session)
            if recorded is not None:
                return recorded
        journal_form: Body = payload.journal_form() if isinstance(payload, ReceivedStep) else payload
        try:
            payload_text = encode_body(journal_form)  # what the store writes; no await until it has it
        except InvalidRecord as exc:
            raise RecordRejected(f"cannot journal this request: {exc}") from None
        try:
            applied = apply_op(self.state, self.sessions, op, payload, self.clock())
        except Exception:
            self._unexpected_kv_changes(op)
            await self.writer.barrier()   # the refusal may read state not yet durable
            raise
        if not applied.mutated:
            self._unexpected_kv_changes(op)
            if session is not None:
                self.sessions.settle(session, True)   # what is pipelined after it may go
            await self.writer.barrier()   # likewise an answer that changed nothing
            return applied.result
        kv_ticket = self._stage_kv_changes()
        record = NewRecord(request_id, op, journal_form, applied.result, digest, payload_text)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = Recorded(digest, applied.result, fut)
        if session is not None:
            self.sessions.record(session, Answer(digest, applied.result, self.wall_clock(), fut))
        else:
            self._requests.put(request_id, entry)
        for listener in self._listeners:
            listener(op, applied.result)
        try:
            entry.seq_no = await self.writer.commit(record, self._kv_on_commit(kv_ticket))
            fut.set_result(entry.seq_no)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody else must log it
            raise
        return applied.result

    def _apply_volatile(
        self, op: str, request_id: str, digest: str, payload: dict[str, Any] | ReceivedStep,
        session: SessionRef | None,
    ) -> Body:
        """In-memory mode: same state machine, request-id index and sessions, no journal."""
        applied = apply_op(self.state, self.sessions, op, payload, self.clock())
        self.kv_events.commit(self._stage_kv_changes())
        if not applied.mutated and session is not None:
            self.sessions.settle(session, True)
        if applied.mutated:
            if session is not None:
                self.sessions.record(session, Answer(digest, applied.result, self.wall_clock(), None))
            else:
                self._requests.put(request_id, Recorded(digest, applied.result, None))
            self.writer.last_seq_no += 1
            self.writer.num_records += 1
            for listener in self._listeners:
                listener(op, applied.result)
        return applied.result

    def _unexpected_kv_changes(self, op: str) -> None:
        """An op that failed or changed nothing leaves the state as it was, hence no changes;
        should one slip through anyway, it is published (in order) rather than hidden."""
        ticket = self._stage_kv_changes()
        if ticket is not None:
            log.error("prefix index changed by an op that reported no change", op=op, num=len(ticket[0]))
            self.kv_events.commit(ticket)

    async def mutate_step(
        self, request_id: str, digest: str, received: ReceivedStep, session: SessionRef | None = None,
    ) -> Body:
        """One scheduler step. A pool held by another scheduler whose lease has lapsed is
        handed over first (a journaled `release_pool`: the old holder's sequences are
        dropped), then the step runs; a live lease of another scheduler refuses it.

        A fleet member's step is marked as such in its journaled payload (`fleet`): it drives
        only the pools the fleet gave it and takes no other (service/fleet.py)."""
        received.fleet = self.fleet.is_member(received.scheduler_id)
        try:
            return await self._mutate("step", request_id, digest, received, session=session, lease_retry=True)
        except PoolLeased:
            released = False
            try:
                released = await self._release_lapsed(received)
            finally:
                if not released and session is not None:
                    self.sessions.settle(session, False)   # its refusal is final now
            if not released:
                raise
            return await self._mutate("step", request_id, digest, received, session=session)

    # ---- client sessions ------------------------------------------------------------
    async def open_session(self, client_name: str) -> dict[str, Any]:
        """A new client session (journaled, so it survives a restart). The id is random and
        never reused: a request naming an id the server does not hold is refused, never
        applied."""
        self.check_writable()
        self.sessions.can_open()
        sid = uuid.uuid4().hex
        rid = internal_request_id("session-open", sid)
        payload = {"session_id": sid, "client_name": client_name}
        return await self.mutate("open_session", rid, rid, payload, internal=True)

    def _arm_session_sweep(self) -> None:
        if self.phase not in ("serving", "draining"):
            return
        c = self.config
        delay = min(max(min(c.session_window_s, c.session_ttl_s) / 4, 0.05), 30.0)
        self._session_timer = asyncio.get_running_loop().call_later(delay, self._on_session_timer)

    def _on_session_timer(self) -> None:
        self._session_timer = None
        self.sessions.prune(self.wall_clock())
        idle = self.sessions.idle(self.clock())
        if idle:
            self.tasks.spawn(self._expire_sessions(idle), name="session-expiry")
        else:
            self._arm_session_sweep()

    async def _expire_sessions(self, session_ids: list[str]) -> None:
        rid = internal_request_id("session-expire", uuid.uuid4().hex)
        try:
            result = await self.mutate("expire_sessions", rid, rid, {"session_ids": session_ids}, internal=True)
            log.info("client sessions expired", num=result["num_expired"])
        except Exception as exc:  # noqa: BLE001 - logged; the next sweep tries again
            log.error("session expiry failed", error=clip(repr(exc)))
        self._arm_session_sweep()

    async def _release_lapsed(self, received: ReceivedStep) -> bool:
        state = self.state
        try:
            step = received.decode(state.config.max_batch)
        except Exception:  # noqa: BLE001 - the step itself reports its malformed payload
            return False
        if step.fleet:
            return False   # a member takes no pool by stepping on it: the fleet assigns them
        now = self.clock()
        released = False
        for pid in state.pools_of(step):
            lease = state.leases.blocked(pid, step.scheduler_id, now)
            if lease is None or lease.deadline > now:
                continue
            rid = internal_request_id("release", pid, lease.scheduler_id, lease.epoch)
            body = {"pool_id": pid, "scheduler_id": lease.scheduler_id, "epoch": lease.epoch}
            result = await self.mutate("release_pool", rid, rid, body, internal=True)
            log.warning(
                "scheduler lease lapsed; pool handed over", pool=pid, old_scheduler=lease.scheduler_id[:64],
                new_scheduler=step.scheduler_id[:64], dropped=len(result["dropped_seq_ids"]),
            )
            released = True
        return released

    # ---- leases ---------------------------------------------------------------------
    def heartbeat(self, node_id: str, epoch: int) -> float:
        self.check_readable()
        lease = self.state.registry.heartbeat(node_id, epoch, self.clock())
        return lease.lease_ttl_s

    def schedule_lease_check(self) -> None:
        """Arm one timer at the earliest lease deadline (re-armed after it fires or after a
        registration); no periodic polling."""
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        if self.phase not in ("serving", "draining"):
            return
        deadline = self.state.registry.next_deadline()
        if deadline is None:
            return
        delay = max(0.0, deadline - self.clock()) + 0.001
        self._lease_timer = asyncio.get_running_loop().call_later(delay, self._on_lease_timer)

    def _on_lease_timer(self) -> None:
        self._lease_timer = None
        expired = self.state.registry.expired(self.clock())
        if expired:
            self.tasks.spawn(self._expire([(n.node_id, n.epoch) for n in expired]), name="lease-expiry")
        else:
            self.schedule_lease_check()

    async def _expire(self, nodes: list[tuple[str, int]]) -> None:
        failed = False
        for node_id, epoch in nodes:
            payload = {"node_id": node_id, "epoch": epoch}
            rid = internal_request_id("expire", node_id, epoch)
            try:
                result = await self.mutate("expire_node", rid, rid, payload, internal=True)
            except Exception as exc:  # noqa: BLE001 - logged; retried after a backoff
                log.error("lease expiry failed", node=clip(node_id, 160), epoch=epoch, error=clip(repr(exc)))
                failed = True
                continue
            log.warning("lease expired; node fenced", node=node_id, epoch=epoch, dropped=len(result["dropped_seq_ids"]))
        if not failed:
            self._expiry_backoff.reset()
            self.schedule_lease_check()
        elif self.phase in ("serving", "draining"):
            delay = self._expiry_backoff.next_delay()
            self._lease_timer = asyncio.get_running_loop().call_later(delay, self._on_lease_timer)

    # ---- stats ----------------------------------------------------------------------
    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def store_kind(self) -> str:
        try:
            return str(self.store.stats().backend)
        except Exception:  # noqa: BLE001 - informational only
            return "unknown"


__all__ = ["Phase", "ServiceRuntime", "apply_op", "internal_request_id", "replay_record"]
