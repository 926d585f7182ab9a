"""Client sessions: exactly-once for mutating requests, also past the request-id window.

A request id alone cannot give exactly-once: the server forgets old ids (it must, memory and
journal are bounded), and a resend that arrives after its id was forgotten looks new and is
applied a second time. Sessions close that hole the way Raft's client table and etcd do:

- a client opens a session (`OpenSession`, journaled) and numbers its mutating requests
  1, 2, 3, ... within it; every request carries `(session_id, seq, acked)`, where `acked`
  says "I hold the answers of every number below this one";
- per session the server keeps `floor` (every number <= floor is either applied or will never
  be) and the answers of the numbers above it that it applied, each with its wall-clock time;
- a number it holds an answer for gets that answer back (byte-identical: the recorded result);
  a number <= floor, or one whose answer is older than `window_s`, is refused as expired
  (FAILED_PRECONDITION) and never applied again; a new number is applied and recorded;
- memory is bounded three ways: answers below the client's `acked` go at once (a correct
  client never resends those), answers older than `window_s` go at the next sweep, and at most
  `max_answers` per session are held (the oldest go first, raising the floor); the number
  of sessions is capped (`max_sessions`; opening one more is RESOURCE_EXHAUSTED);
- a session unused for `ttl_s` expires (journaled `expire_sessions`); a request naming an
  unknown or expired session is refused (FAILED_PRECONDITION, message "session expired: ..."),
  never applied: session ids are random and never reused, so an unknown id can only be one the
  server forgot.

Durability: `open_session` and `expire_sessions` are journal records; a sessioned request is
journaled under the id `session_request_id(session, seq)`, so replaying the journal rebuilds
each session's answers from the records (with their `created_at` as the applied time), and
the snapshot carries the table (floor + held answers). Deadlines (TTL) restart at recovery,
like node leases. `window_s` must be at least the clients' resend window (the engine resends an
unanswered step for `bm_unavailable_timeout_s`, 120 s by default): the default is 300 s.

Pipelining. A client may send request `seq` before the answer of an earlier one arrived, naming
it as `after` (`ClientSession.after`): gRPC may hand the two to the server in either order, so
the server applies `seq` only once `after` was applied, and refuses it (`PredecessorFailed`,
FAILED_PRECONDITION) when `after` was refused or does not arrive within `pipeline_wait_s`. The
guarantees (docs/durability.md "Pipelined Steps"):

- order: `seq` is applied after `after`, so it is journaled after it: in the same group commit
  or a later one. Its answer leaves only once its record is durable, hence `after`'s too; the
  two share one fsync when they arrive within one commit, which is what pipelining buys;
- failure: `seq` is never applied when `after` failed; a refusal of `seq` (for this or any
  reason) fails whatever names `seq` as its `after` in turn;
- a refused `seq` changed nothing: the client replans it (new number) after resending or
  giving up `after`; it must not resend `seq` itself once `after` failed.

What a number's op ended as (applied and answered, or refused) is kept per session
(`outcomes`, the newest `MAX_OUTCOMES`, not durable): after a restart a predecessor is known
applied from its journaled answer or the floor; one whose fate was lost with the process
(applied but not journaled because it changed nothing, or refused) is waited for and then
refused, which is the safe side.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from block_manager.core.errors import InvalidRequest
from block_manager.service.errors import RequestExpired, RequestIdConflict, SessionExpired, TooManySessions
from block_manager.service.request_index import INTERNAL_MARK, internal_request_id
from block_manager.store.records import Body, Packed

SESSION_OPS = ("open_session", "expire_sessions")
MAX_SESSION_ID_LEN = 64
MAX_CLIENT_NAME_LEN = 128
MAX_OUTCOMES = 256         # per session: the newest unanswered outcomes kept for pipelined requests
PIPELINE_WAIT_S = 5.0      # how long a pipelined request waits for its predecessor to arrive
_SESSION_KIND = "session"


@dataclass(slots=True, frozen=True)
class SessionRef:
    """What a sessioned request carries: its session, its number, and the client's ack
    (every number below `acked` was answered; 0: nothing said)."""

    session_id: str
    seq: int
    acked: int = 0
    after: int = 0    # pipelining: apply only after this number of the session (0: none)


@dataclass(slots=True)
class Answer:
    digest: str
    result: Body                            # a Step's packed answer, or the op's dict
    applied_at: float                       # wall clock (seconds since the epoch)
    committed: asyncio.Future[int] | None   # None: known committed


@dataclass(slots=True)
class ClientSession:
    session_id: str
    client_name: str
    last_used: float                        # monotonic; for the TTL
    floor: int = 0
    answers: OrderedDict[int, Answer] = field(default_factory=OrderedDict)
    # Pipelining (not durable): numbers whose op ended without a held answer (True: applied but
    # not journaled, it changed nothing; False: refused), and the requests waiting on a number.
    outcomes: OrderedDict[int, bool] = field(default_factory=OrderedDict)
    waiters: dict[int, list[asyncio.Future[bool]]] = field(default_factory=dict)

    @property
    def highest_seq(self) -> int:
        return max(self.floor, next(reversed(self.answers), 0))


def session_request_id(session_id: str, seq: int) -> str:
    """The journal's request id of a sessioned request (internal namespace, unique)."""
    return internal_request_id(_SESSION_KIND, session_id, seq)


def parse_session_request_id(request_id: str) -> tuple[str, int] | None:
    parts = request_id.split(INTERNAL_MARK)
    if len(parts) != 4 or parts[0] or parts[1] != _SESSION_KIND:
        return None
    try:
        return parts[2], int(parts[3])
    except ValueError:
        return None


def check_session_ref(session_id: str, seq: int, acked: int, after: int = 0) -> SessionRef:
    if not 0 < len(session_id) <= MAX_SESSION_ID_LEN or not session_id.isascii() or not session_id.isalnum():
        raise InvalidRequest(f"session_id must be 1..{MAX_SESSION_ID_LEN} ASCII letters and digits")
    if seq < 1:
        raise InvalidRequest("a sessioned request needs seq >= 1")
    if acked > seq:
        raise InvalidRequest(f"acked ({acked}) cannot exceed the request's own seq ({seq})")
    if after >= seq:
        raise InvalidRequest(f"after ({after}) must name an earlier number than the request's own ({seq})")
    return SessionRef(session_id, seq, acked, after)


class SessionTable:
    def __init__(self, *, window_s: float, ttl_s: float, max_sessions: int, max_answers: int,
                 pipeline_wait_s: float = PIPELINE_WAIT_S) -> None:
        self.pipeline_wait_s = pipeline_wait_s
        self.window_s = window_s
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_answers = max_answers
        self._sessions: dict[str, ClientSession] = {}
        self.num_expired_refusals = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> ClientSession | None:
        return self._sessions.get(session_id)

    @property
    def num_answers(self) -> int:
        return sum(len(s.answers) for s in self._sessions.values())

    # ---- journaled ops (live and replay) --------------------------------------------
    def can_open(self) -> None:
        if len(self._sessions) >= self.max_sessions:
            raise TooManySessions(f"{self.max_sessions} client sessions are open; retry when some expire")

    def apply(self, op: str, payload: Mapping[str, Any], mono_now: float) -> tuple[dict[str, Any], bool]:
        if op == "open_session":
            sid = str(payload["session_id"])
            if sid not in self._sessions:
                self._sessions[sid] = ClientSession(sid, str(payload.get("client_name", "")), mono_now)
            return {"session_id": sid, "ttl_s": self.ttl_s, "window_s": self.window_s}, True
        if op == "expire_sessions":
            gone = [sid for sid in payload["session_ids"] if self._sessions.pop(sid, None) is not None]
            return {"num_expired": len(gone)}, bool(gone)
        raise InvalidRequest(f"unknown session operation {op!r}")

    # ---- the request path -----------------------------------------------------------
    def lookup(self, ref: SessionRef, digest: str, wall_now: float, mono_now: float) -> Answer | None:
        """The recorded answer of `ref` (None: a new number, to be applied). Renews the
        session and drops the answers the client acknowledged. Raises `SessionExpired`,
        `RequestExpired` (an applied number whose answer is gone) or `RequestIdConflict`."""
        sess = self._sessions.get(ref.session_id)
        if sess is None:
            self.num_expired_refusals += 1
            raise SessionExpired(
                f"session expired: session {ref.session_id!r} is unknown or expired; "
                "open a new session (a request resent in the old one is never applied)"
            )
        sess.last_used = mono_now
        self._ack(sess, ref.acked)
        answer = sess.answers.get(ref.seq)
        if answer is not None:
            if answer.digest != digest:
                raise RequestIdConflict(f"session {ref.session_id!r} number {ref.seq} was used for a different request")
            in_flight = answer.committed is not None and not answer.committed.done()
            if in_flight or answer.applied_at >= wall_now - self.window_s:
                return answer
            self._drop_through(sess, ref.seq)
        if ref.seq <= sess.floor:
            self.num_expired_refusals += 1
            raise RequestExpired(
                f"session {ref.session_id!r} number {ref.seq} expired: it was applied (or superseded) and its "
                f"answer is no longer held (answers are kept {self.window_s:g} s); it is not applied again"
            )
        return None

    def record(self, ref: SessionRef, answer: Answer) -> None:
        """`ref` was applied (its answer in flight to the journal): held, and the requests
        pipelined after it may go (they are journaled after it)."""
        sess = self._sessions.get(ref.session_id)
        if sess is None:   # expired while the op was applied: nothing to record into
            return
        self._put(sess, ref.seq, answer)
        self._ended(sess, ref.seq, True)

    # ---- pipelining -----------------------------------------------------------------
    def settle(self, ref: SessionRef, applied: bool) -> None:
        """`ref`'s op ended without a held answer: applied but not journaled (it changed
        nothing), or refused (`applied=False`). Wakes the requests pipelined after it."""
        sess = self._sessions.get(ref.session_id)
        if sess is None:
            return
        sess.outcomes[ref.seq] = applied
        sess.outcomes.move_to_end(ref.seq)
        while len(sess.outcomes) > MAX_OUTCOMES:
            sess.outcomes.popitem(last=False)
        self._ended(sess, ref.seq, applied)

    @staticmethod
    def _ended(sess: ClientSession, seq: int, applied: bool) -> None:
        if applied and seq in sess.answers:
            sess.outcomes.pop(seq, None)   # a resend applied after an earlier refusal
        for fut in sess.waiters.pop(seq, ()):
            if not fut.done():
                fut.set_result(applied)

    def predecessor(self, ref: SessionRef) -> bool | None:
        """Whether `ref.after` was applied (True), refused (False), or is not known yet (None)."""
        sess = self._sessions.get(ref.session_id)
        if sess is None:
            return False
        known = sess.outcomes.get(ref.after)
        if known is not None:
            return known
        if ref.after in sess.answers or ref.after <= sess.floor:
            return True
        return None

    def wait_for(self, ref: SessionRef) -> asyncio.Future[bool]:
        """Done with `ref.after`'s outcome (True: applied) once it ends."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        sess = self._sessions.get(ref.session_id)
        if sess is None:
            fut.set_result(False)
        else:
            sess.waiters.setdefault(ref.after, []).append(fut)
        return fut

    def forget_waiter(self, ref: SessionRef, fut: asyncio.Future[bool]) -> None:
        sess = self._sessions.get(ref.session_id)
        if sess is not None and fut in sess.waiters.get(ref.after, ()):
            sess.waiters[ref.after].remove(fut)
            if not sess.waiters[ref.after]:
                del sess.waiters[ref.after]

    def replay(self, request_id: str, digest: str, result: Body, applied_at: float) -> bool:
        """A journal record of a sessioned request, at recovery (False: not one)."""
        parsed = parse_session_request_id(request_id)
        if parsed is None:
            return False
        sess = self._sessions.get(parsed[0])
        if sess is not None and parsed[1] > sess.floor:
            self._put(sess, parsed[1], Answer(digest, result, applied_at, None))
        return True

    def _put(self, sess: ClientSession, seq: int, answer: Answer) -> None:
        sess.answers[seq] = answer
        if len(sess.answers) > 1 and seq < next(reversed(sess.answers)):
            sess.answers = OrderedDict(sorted(sess.answers.items()))
        while len(sess.answers) > self.max_answers:
            old_seq, old = next(iter(sess.answers.items()))
            if old.committed is not None and not old.committed.done():
                break   # in flight: its concurrent resends need it
            del sess.answers[old_seq]
            sess.floor = max(sess.floor, old_seq)

    @staticmethod
    def _ack(sess: ClientSession, acked: int) -> None:
        if acked <= 1:
            return
        SessionTable._drop_through(sess, acked - 1)

    @staticmethod
    def _drop_through(sess: ClientSession, seq: int) -> None:
        """Forget every answer <= seq and raise the floor to it — or, when an answer still in
        flight is in the way (its concurrent resends need it), to just below that one."""
        answers = sess.answers
        while answers:
            first, ans = next(iter(answers.items()))
            if first > seq:
                break
            if ans.committed is not None and not ans.committed.done():
                seq = first - 1
                break
            del answers[first]
        sess.floor = max(sess.floor, seq)

    # ---- housekeeping ---------------------------------------------------------------
    def prune(self, wall_now: float) -> int:
        """Drop answers older than the window (memory only: the check in `lookup` is what
        refuses them, so this need not be journaled). Returns how many went."""
        cutoff = wall_now - self.window_s
        dropped = 0
        for sess in self._sessions.values():
            last_old = None
            for seq, ans in sess.answers.items():
                if ans.applied_at >= cutoff:
                    break
                last_old = seq
            if last_old is not None:
                before = len(sess.answers)
                self._drop_through(sess, last_old)
                dropped += before - len(sess.answers)
        return dropped

    def idle(self, mono_now: float) -> list[str]:
        """Sessions unused for `ttl_s` (to expire through a journaled op)."""
        return sorted(sid for sid, s in self._sessions.items() if s.last_used + self.ttl_s < mono_now)

    def renew_all(self, mono_now: float) -> None:
        for sess in self._sessions.values():
            sess.last_used = mono_now

    # ---- snapshots ------------------------------------------------------------------
    def to_snapshot(self) -> list[list[Any]]:
        out = []
        for s in self._sessions.values():
            # a packed answer as its stored text (a string: JSON answers are objects)
            answers = [[q, a.digest, a.result.to_text() if isinstance(a.result, Packed) else a.result, a.applied_at]
                       for q, a in s.answers.items()]
            out.append([s.session_id, s.client_name, s.floor, answers])
        return out

    def load_snapshot(self, data: list[list[Any]] | None, mono_now: float) -> None:
        for sid, name, floor, answers in data or []:
            sess = ClientSession(sid, name, mono_now, floor)
            for seq, digest, result, applied_at in answers:
                body = Packed.from_text(result) if isinstance(result, str) else result
                sess.answers[seq] = Answer(digest, body, applied_at, None)
            self._sessions[sid] = sess


__all__ = [
    "MAX_CLIENT_NAME_LEN",
    "SESSION_OPS",
    "Answer",
    "SessionRef",
    "SessionTable",
    "check_session_ref",
    "parse_session_request_id",
    "session_request_id",
]
