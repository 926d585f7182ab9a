"""The client's half of a block-manager session (server half: `block_manager/service/sessions.py`).

Every mutating request this client sends is stamped once with `(session_id, seq, acked)`:
`seq` numbers the client's mutating requests 1, 2, 3, ... and a resend repeats the stamp
(request id included), so the server answers it from its session table — the recorded answer
while it holds it (its session window, 300 s by default), else FAILED_PRECONDITION "expired",
never a second application. `acked` is the lowest number whose outcome the client may still
need (every lower number got a definite answer or error), which lets the server drop answers
at once instead of holding them for the whole window.

The session is opened lazily by the first mutating call (`OpenSession`, retried like any call:
an extra session from a lost answer is harmless, it just expires unused), and replaced by a
new one when it has been idle for half its TTL or the server says it expired. A server without
`OpenSession` (UNIMPLEMENTED: an older server, the engine's in-process block manager) turns
sessions off for this client: requests are then deduplicated by request id alone.

`pipelined`: every new number is stamped `after` the newest number still in flight (sent, no
outcome yet), so the server applies it only after that one and refuses it when that one failed
(`ClientSession.after`, docs/durability.md "Pipelined Steps"). A number whose outcome stayed
unknown (UNAVAILABLE) is not waited on by later ones: the caller resends it first, as without
pipelining.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagedkv.v1 import block_manager_pb2 as pb

MAX_UNSETTLED = 64   # numbers with an unknown outcome kept for a resend; older ones are given up
EXPIRED_PREFIX = "session expired:"


@dataclass(slots=True)
class ClientSessionState:
    enabled: bool = True
    session_id: str | None = None
    ttl_s: float = 0.0
    window_s: float = 0.0
    next_seq: int = 1
    last_used: float = 0.0
    # numbers sent whose outcome is unknown (in flight, or failed as UNAVAILABLE / deadline)
    unsettled: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pipelined: bool = False   # stamp `after`: see the module docstring
    in_flight: set[int] = field(default_factory=set)   # new numbers sent, no outcome yet

    def needs_open(self, now: float | None = None) -> bool:
        if not self.enabled:
            return False
        now = time.monotonic() if now is None else now
        return self.session_id is None or now - self.last_used > self.ttl_s / 2

    def adopt(self, reply: pb.OpenSessionResponse) -> None:
        self.session_id = reply.session_id
        self.ttl_s, self.window_s = reply.ttl_s, reply.window_s
        self.next_seq = 1
        self.unsettled.clear()
        self.in_flight.clear()
        self.last_used = time.monotonic()

    def disable(self) -> None:
        self.enabled = False
        self.session_id = None

    @property
    def acked(self) -> int:
        return next(iter(self.unsettled), self.next_seq)

    def stamp(self, request: Any) -> None:
        """Give `request` the next number (once: a resend keeps its stamp, only its ack moves)."""
        if self.session_id is None:
            return
        if request.HasField("session"):
            if request.session.session_id == self.session_id:
                request.session.acked = min(self.acked, request.session.seq)
            return
        seq = self.next_seq
        self.next_seq += 1
        if self.pipelined:
            request.session.after = max(self.in_flight, default=0)
            self.in_flight.add(seq)
        self.unsettled[seq] = None
        while len(self.unsettled) > MAX_UNSETTLED:
            self.unsettled.popitem(last=False)
        request.session.session_id = self.session_id
        request.session.seq = seq
        request.session.acked = self.acked
        self.last_used = time.monotonic()

    def returned(self, request: Any) -> None:
        """`request`'s call ended, with an answer or an error of any kind."""
        if request.HasField("session"):
            self.in_flight.discard(request.session.seq)

    def settle(self, request: Any) -> None:
        """`request` got a definite outcome (an answer, or an error other than UNAVAILABLE /
        deadline): its number will not be resent."""
        if request.HasField("session") and request.session.session_id == self.session_id:
            self.unsettled.pop(request.session.seq, None)

    def lost(self, message: str) -> None:
        """The server refused with `message`: when it says the session expired, the next
        mutating call opens a new one."""
        if message.startswith(EXPIRED_PREFIX):
            self.session_id = None


__all__ = ["EXPIRED_PREFIX", "MAX_UNSETTLED", "ClientSessionState"]
