"""Replaying journal records: the one dispatch of a journaled op (client-session bookkeeping or
the state machine), shared by live requests, recovery and a standby following the journal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from block_manager.core.errors import InvalidRequest
from block_manager.service.errors import RecoveryError
from block_manager.service.sessions import SESSION_OPS, SessionTable
from block_manager.service.state import ServiceState
from block_manager.service.step_codec import ReceivedStep
from block_manager.store.records import Body, JournalRecord, Packed
from pagedkv.v1 import block_manager_pb2 as pb


@dataclass(slots=True, frozen=True)
class AppliedOp:
    """What `apply_op` did: the op's answer as recorded (a live Step's packed by its
    `ReceivedStep`, every other a dict) and whether it changed the state."""

    result: Body
    mutated: bool


def apply_op(
    state: ServiceState, sessions: SessionTable, op: str, payload: dict[str, Any] | ReceivedStep | Packed, now: float,
) -> AppliedOp:
    """The one dispatch of a journaled op: session bookkeeping or the state machine. A live
    Step arrives as its `ReceivedStep` (decoded straight from the message, its answer recorded
    by it); a journaled one as its packed request (`step-request/1`, decoded the same way) or,
    written before that format, as its JSON payload."""
    if isinstance(payload, Packed):
        if op != "step":
            raise InvalidRequest(f"a packed payload ({payload.format!r}) for op {op!r}")
        payload = ReceivedStep.from_packed(payload, pb.StepRequest.FromString)
    if isinstance(payload, ReceivedStep):
        answer, mutated = state.step_answer(payload.decode(state.config.max_batch), now)
        return AppliedOp(payload.record(answer), mutated)
    if op in SESSION_OPS:
        result, mutated = sessions.apply(op, payload, now)
        return AppliedOp(result, mutated)
    applied = state.apply(op, payload, now)
    return AppliedOp(applied.result, applied.mutated)


def replay_record(state: ServiceState, sessions: SessionTable, rec: JournalRecord, now: float) -> None:
    """Replay one journal record (recovery; anything that follows the journal, e.g. a standby):
    the op through `apply_op`, and a sessioned request's answer into the session table, timed by
    the record's `created_at`."""
    try:
        apply_op(state, sessions, rec.op, rec.payload, now)
    except Exception as exc:
        raise RecoveryError(f"journal record {rec.seq_no} ({rec.op}) does not replay: {exc}") from exc
    sessions.replay(rec.request_id, rec.payload_digest, rec.result, rec.created_at)


__all__ = ["AppliedOp", "apply_op", "replay_record"]
