"""Service-level errors: the conditions that exist only around the core.

The core raises `CoreError` subclasses; the service adds a few of its own (a server that is
recovering or draining, a reused or expired request id, a missing admin token, a journal
that cannot be written). Nothing here knows the transport: which gRPC status a client sees
is decided in one table, `service/status.py`, used by the interceptor for whole-RPC failures
and by the servicer for the per-item errors of batched responses. The state machine records
item errors by class name (`reason`), so the durable journal never depends on gRPC.
"""

from __future__ import annotations

from block_manager.core.errors import OutOfBlocks


class ServiceError(Exception):
    """Base of errors raised by the service layer (not the core)."""


class ServerUnavailable(ServiceError):
    """The server as a whole cannot take the call now (recovering, draining, stopping)."""


class RequestIdConflict(ServiceError):
    """A request id was reused for a request with a different payload."""


class RequestExpired(ServiceError):
    """A retried request id the server still remembers but whose recorded result is no
    longer retained (in memory or in the journal): refusing it is the only answer that
    cannot act twice."""


class SessionExpired(ServiceError):
    """A sessioned request named a session the server does not hold (expired, or never
    opened): refused, never applied (`service/sessions.py`)."""


class PredecessorFailed(ServiceError):
    """A pipelined request (`ClientSession.after`) whose predecessor in its session failed, or
    did not arrive in time: refused, never applied (`service/sessions.py`, "Pipelining")."""


class TooManySessions(ServiceError):
    """`max_sessions` client sessions are open: no new one until some expire."""


class RecordRejected(ServiceError):
    """The request cannot be journaled because of its own content (an id or digest too long
    for the store's columns, a payload that is not JSON). Raised before anything is applied:
    the request fails (INVALID_ARGUMENT), the server goes on serving."""


class Unauthenticated(ServiceError):
    """An admin-plane call without the configured bearer token."""


class JournalFailure(ServiceError):
    """The journal could not be written: the state is ahead of the durable record, so the
    server stops serving rather than acknowledge anything it could lose (fail-stop)."""


class RecoveryError(ServiceError):
    """The journal/snapshot could not be replayed into a consistent state."""


class NotPlaced(OutOfBlocks):
    """A placed allocation (issue 21) that no candidate pool takes in this step: none admits
    sequences this scheduler may drive, none has the blocks, or the step's admission budget
    is spent. It changes nothing and simply waits (RESOURCE_EXHAUSTED, like OutOfBlocks)."""


__all__ = [
    "JournalFailure",
    "NotPlaced",
    "PredecessorFailed",
    "RecordRejected",
    "RecoveryError",
    "RequestExpired",
    "RequestIdConflict",
    "ServerUnavailable",
    "SessionExpired",
    "ServiceError",
    "TooManySessions",
    "Unauthenticated",
]
