"""Service-level errors and the single table that maps every domain error to a gRPC code.

The core raises `CoreError` subclasses; the service adds a few conditions that only exist
around it (a server that is recovering or draining, a reused request id, a missing admin
token). `status_for` is the one place that decides which gRPC status a client sees, used by
the error-mapping interceptor for whole-RPC failures and by the servicer for the per-item
errors of batched responses, so both always agree.
"""

from __future__ import annotations

import grpc

from block_manager.core.errors import (
    CoreError,
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    SequenceExists,
    UnknownPlan,
    UnknownPool,
    UnknownSequence,
    VersionConflict,
)


class ServiceError(Exception):
    """Base of errors raised by the service layer (not the core)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ServerUnavailable(ServiceError):
    """The server as a whole cannot take the call now (recovering, draining, stopping)."""

    code = grpc.StatusCode.UNAVAILABLE


class RequestIdConflict(ServiceError):
    """A request id was reused for a request with a different payload."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class RequestExpired(ServiceError):
    """A retried request id whose recorded result is no longer retained: refusing it is
    the only answer that cannot act twice."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(ServiceError):
    """An admin-plane call without the configured bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class JournalFailure(ServiceError):
    """The journal could not be written: the state is ahead of the durable record, so the
    server stops serving rather than acknowledge anything it could lose (fail-stop)."""

    code = grpc.StatusCode.UNAVAILABLE


class RecoveryError(ServiceError):
    """The journal/snapshot could not be replayed into a consistent state."""


# Most specific first: `status_for` walks the MRO of the exception's class.
_CORE_CODES: dict[type[CoreError], grpc.StatusCode] = {
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSequence: grpc.StatusCode.NOT_FOUND,
    UnknownPool: grpc.StatusCode.NOT_FOUND,
    UnknownPlan: grpc.StatusCode.NOT_FOUND,
    SequenceExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    VersionConflict: grpc.StatusCode.ABORTED,
}


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC code of a domain error, or None when `exc` is not one (→ INTERNAL)."""
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, CoreError):
        for cls in type(exc).__mro__:
            code = _CORE_CODES.get(cls)  # type: ignore[call-overload]
            if code is not None:
                return code
        return grpc.StatusCode.FAILED_PRECONDITION
    return None


__all__ = [
    "JournalFailure",
    "RecoveryError",
    "RequestExpired",
    "RequestIdConflict",
    "ServerUnavailable",
    "ServiceError",
    "Unauthenticated",
    "status_for",
]
