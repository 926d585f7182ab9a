"""Validation helpers and core-result → JSON-shaped conversion for `state.py`.

Results are journaled verbatim (they are what a retried request id gets back), so they are
plain dicts of lists/ints/strings; the servicer turns them into protobuf messages. The step's
own columnar codec is `step_codec.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from block_manager.core.errors import InvalidRequest
from block_manager.core.types import CopyOp, DefragPlan
from pagedkv.limits import MAX_SEQ_ID_LEN

MAX_ID_LEN = MAX_SEQ_ID_LEN   # the compute nodes refuse longer sequence ids too


def check_count(name: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidRequest(f"{name} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def check_optional_str(name: str, value: object, max_len: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidRequest(f"{name} must be a string of at most {max_len} characters")
    return value


def check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LEN:
        raise InvalidRequest(f"{name} must be a non-empty string of at most {MAX_ID_LEN} characters")
    return value


def check_ids(name: str, values: Sequence[object]) -> None:
    """Every id a valid string and no id twice."""
    for v in values:
        check_id(name, v)
    if len(set(values)) != len(values):
        raise InvalidRequest(f"duplicate {name}s in one request")


class CopyOpRecord(NamedTuple):
    """A copy op as results record it (a JSON array in the journal)."""

    op_id: int
    src: int
    dst: int
    kind: str


def op_list(op: CopyOp) -> CopyOpRecord:
    return CopyOpRecord(op.op_id, op.src, op.dst, op.kind)


def plan_dict(plan: DefragPlan) -> dict[str, Any]:
    return {
        "plan_id": plan.plan_id,
        "pool_id": plan.pool_id,
        "kind": plan.kind,
        "moves": [op_list(m) for m in plan.moves],
        "step_id": plan.step_id,
    }


__all__ = [
    "MAX_ID_LEN",
    "CopyOpRecord",
    "check_count",
    "check_id",
    "check_ids",
    "check_optional_str",
    "op_list",
    "plan_dict",
]
