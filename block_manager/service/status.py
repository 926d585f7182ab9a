"""The one table from domain errors to gRPC status codes (design §3).

Used by `ErrorMappingInterceptor` for whole-RPC failures and by the servicer for the per-item
errors of batched responses, so both always agree. Item errors are recorded by the state
machine as `{"reason": <class name>, "message": ...}` (transport-free, journal-safe); the
servicer turns the reason back into a code with `code_for_reason`.

Every message that reaches a client goes through `clip` (re-exported from `pagedkv.rpc`):
the interceptor applies it to whole-RPC details, the servicers to per-item messages.
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
from block_manager.service.errors import (
    JournalFailure,
    PredecessorFailed,
    RecordRejected,
    RecoveryError,
    RequestExpired,
    RequestIdConflict,
    ServerUnavailable,
    SessionExpired,
    TooManySessions,
    Unauthenticated,
)
from pagedkv.rpc import MAX_DETAIL_CHARS, clip

# Most specific first: `status_for` walks the MRO of the exception's class.
_CODES: dict[type[Exception], grpc.StatusCode] = {
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSequence: grpc.StatusCode.NOT_FOUND,
    UnknownPool: grpc.StatusCode.NOT_FOUND,
    UnknownPlan: grpc.StatusCode.NOT_FOUND,
    SequenceExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    VersionConflict: grpc.StatusCode.ABORTED,
    CoreError: grpc.StatusCode.FAILED_PRECONDITION,
    ServerUnavailable: grpc.StatusCode.UNAVAILABLE,
    RequestIdConflict: grpc.StatusCode.INVALID_ARGUMENT,
    RecordRejected: grpc.StatusCode.INVALID_ARGUMENT,
    RequestExpired: grpc.StatusCode.FAILED_PRECONDITION,
    SessionExpired: grpc.StatusCode.FAILED_PRECONDITION,
    PredecessorFailed: grpc.StatusCode.FAILED_PRECONDITION,
    TooManySessions: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    JournalFailure: grpc.StatusCode.UNAVAILABLE,
    RecoveryError: grpc.StatusCode.INTERNAL,
}


def _code_of(cls: type[BaseException]) -> grpc.StatusCode | None:
    for base in cls.__mro__:
        code = _CODES.get(base)
        if code is not None:
            return code
    return None


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC code of a domain error, or None when `exc` is not one (→ INTERNAL)."""
    return _code_of(type(exc))


def _reasons() -> dict[str, grpc.StatusCode]:
    """Every core error class by name (what item errors record) → its code."""
    table: dict[str, grpc.StatusCode] = {}
    pending: list[type[BaseException]] = [CoreError]
    while pending:
        cls = pending.pop()
        table[cls.__name__] = _code_of(cls) or grpc.StatusCode.FAILED_PRECONDITION
        pending.extend(cls.__subclasses__())
    return table


_REASON_CODES = _reasons()


def code_for_reason(reason: str) -> grpc.StatusCode:
    """The code of a recorded item error's `reason` (an error class name)."""
    return _REASON_CODES.get(reason, grpc.StatusCode.FAILED_PRECONDITION)


__all__ = ["MAX_DETAIL_CHARS", "clip", "code_for_reason", "status_for"]
