"""Typed client-side errors, one class per gRPC status the block manager uses.

Callers branch on exception types, not on status codes: a scheduler catches
`OutOfBlocksError` to preempt, `NotFoundError` / `FailedPreconditionError` to drop a
sequence whose node was fenced, and lets `UnavailableError` bubble up after the client's
own bounded retries gave up. The server's message is kept verbatim; `reason` carries the
machine-readable class name of per-item errors (`OutOfBlocks`, `PoolDraining`, ...).
"""

from __future__ import annotations

import grpc


class BlockManagerError(Exception):
    """Base of every error the client raises for a block manager answer (or its absence)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, reason: str = "", method: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.method = method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code.name}: {self.message}"


class OutOfBlocksError(BlockManagerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InvalidArgumentError(BlockManagerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(BlockManagerError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(BlockManagerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(BlockManagerError):
    """Double free, stale epoch, fenced node, draining pool: the state forbids the call."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PoolGoneError(FailedPreconditionError):
    """A per-item refusal because the sequence's pool is gone: its node was fenced, registered
    a new epoch, or is unknown. The block manager dropped the node's sequences with it, so
    there is nothing to free; a scheduler recomputes them elsewhere."""


class PoolDrainingError(FailedPreconditionError):
    """A per-item refusal because the pool is draining: it admits no new sequence (nor a fork
    child); its running sequences go on."""


class PendingWriteError(FailedPreconditionError):
    """A per-item refusal because the item needs a block whose writing step is not reported yet
    (a swap-in before its swap-out's step was reported): it can be sent again once it is."""


class AbortedError(BlockManagerError):
    """Version conflict."""

    code = grpc.StatusCode.ABORTED


class UnavailableError(BlockManagerError):
    """Unreachable, recovering or draining server (after the client's retries)."""

    code = grpc.StatusCode.UNAVAILABLE


class CancelledError(UnavailableError):
    """The server cancelled the call (it stopped mid-call) after the client's retries: as
    with UNAVAILABLE, the outcome is unknown and a resend under the same request id is safe."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceededError(BlockManagerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(BlockManagerError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(BlockManagerError):
    """Valid credentials that may not make this call (a node acting for another node, a
    scheduler on the admin plane, ...)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InternalError(BlockManagerError):
    code = grpc.StatusCode.INTERNAL


class StepStateError(BlockManagerError):
    """The client's local view of a sequence disagrees with the block manager's answer
    (e.g. a slot computed for a deferred append differs from the one the server assigned).

    It means the single-writer assumption of the step helper was broken — another client
    appended to or forked the sequence — so the local view cannot be trusted any more.
    """

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE: dict[grpc.StatusCode, type[BlockManagerError]] = {
    cls.code: cls
    for cls in (
        OutOfBlocksError,
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        AbortedError,
        UnavailableError,
        CancelledError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
        InternalError,
    )
}
# Per-item refusals typed by their reason (the core's class name), whatever their status code.
_BY_REASON: dict[str, type[BlockManagerError]] = {
    "NodeFenced": PoolGoneError,
    "StaleEpoch": PoolGoneError,
    "UnknownPool": PoolGoneError,
    "PoolDraining": PoolDrainingError,
    "PendingWrite": PendingWriteError,
}
_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code_from_int(value: int) -> grpc.StatusCode:
    """The `grpc.StatusCode` with numeric value `value` (UNKNOWN when out of range)."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def error_for(code: grpc.StatusCode, message: str, *, reason: str = "", method: str = "") -> BlockManagerError:
    typed = _BY_REASON.get(reason)
    if typed is not None:
        err = typed(message, reason=reason, method=method)
        err.code = code
        return err
    cls = _BY_CODE.get(code)
    if cls is None:
        err = BlockManagerError(message, reason=reason, method=method)
        err.code = code
        return err
    return cls(message, reason=reason, method=method)


def error_from_rpc(exc: grpc.RpcError, method: str = "") -> BlockManagerError:
    """Translate a `grpc.RpcError` (sync or aio) into the typed error for its status."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = details_fn() if callable(details_fn) else str(exc)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "", method=method)


__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "BlockManagerError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfBlocksError",
    "PermissionDeniedError",
    "PoolDrainingError",
    "PoolGoneError",
    "StepStateError",
    "UnauthenticatedError",
    "UnavailableError",
    "CancelledError",
    "error_for",
    "error_from_rpc",
    "status_code_from_int",
]
