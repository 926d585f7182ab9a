"""Protocol ↔ domain helpers shared by the data-plane and admin servicers.

The request-id rules and digest (what a retry is compared against), the one `_mutate` path
into the runtime, and the builders of messages both planes return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from block_manager.core.errors import InvalidRequest
from block_manager.service.request_index import body_digest, message_body
from block_manager.service.runtime import ServiceRuntime
from block_manager.service.sessions import SessionRef, check_session_ref
from block_manager.service.state import DEFRAG_KINDS
from pagedkv.v1 import block_manager_pb2 as pb

MAX_REQUEST_ID_LEN = 128


def request_digest(method: str, request: Any) -> str:
    """sha256 of `method` + the request's deterministic encoding without its request_id and
    session (`request_index.message_body`; a Step computes it once with its journal form,
    `ReceivedStep.digest`)."""
    return body_digest(method, message_body(request))


def session_of(request: Any) -> SessionRef | None:
    """The request's client session (None: deduplicated by request id only)."""
    if not request.HasField("session"):
        return None
    s = request.session
    return check_session_ref(s.session_id, s.seq, s.acked, s.after)


def check_request_id(request_id: str) -> str:
    if not 0 < len(request_id) <= MAX_REQUEST_ID_LEN or not request_id.isascii() or not request_id.isprintable():
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_LEN} printable ASCII characters")
    return request_id


def copy_op_pb(op: Sequence[Any]) -> pb.CopyOp:
    """From a `CopyOpRecord` or its journaled array."""
    op_id, src, dst, kind = op
    return pb.CopyOp(op_id=op_id, src=src, dst=dst, kind=kind)


def plan_pb(plan: dict[str, Any]) -> pb.DefragPlan:
    return pb.DefragPlan(
        plan_id=plan["plan_id"],
        pool_id=plan["pool_id"],
        kind=plan["kind"],
        moves=[copy_op_pb(m) for m in plan["moves"]],
        step_id=plan.get("step_id", 0),
    )


def defrag_kind(kind: str) -> str:
    kind = kind or "compaction"
    if kind not in DEFRAG_KINDS:
        raise InvalidRequest(f"unknown defrag kind {kind!r} (expected one of {', '.join(DEFRAG_KINDS)})")
    return kind



class MutatingServicer:
    """Base of both servicers: every mutating RPC enters the runtime through `_mutate`."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime

    async def _mutate(self, method: str, request: Any, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Check the request id, digest the request, apply + journal idempotently."""
        rid = check_request_id(request.request_id)
        session = session_of(request)
        return await self.runtime.mutate(op, rid, request_digest(method, request), payload, session=session)


__all__ = [
    "MAX_REQUEST_ID_LEN",
    "MutatingServicer",
    "check_request_id",
    "copy_op_pb",
    "defrag_kind",
    "plan_pb",
    "request_digest",
    "session_of",
]
