"""Validation helpers and core-result → JSON-shaped dict conversion for `state.py`.

Results are journaled verbatim (they are what a retried request id gets back), so they
are plain dicts of lists/ints/strings; the servicer turns them into protobuf messages.
Copy ops are compact `[op_id, src, dst, kind]` lists because AppendSlots results are
journaled once per scheduler step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from block_manager.core.errors import InvalidRequest
from block_manager.core.types import AllocateResult, AppendRequest, AppendResult, CopyOp, DefragPlan, SequenceView

MAX_ID_LEN = 256


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
        raise InvalidRequest(f"{name} must be a non-empty string of at most {MAX_ID_LEN} characters, got {value!r}")
    return value


def check_ids(name: str, values: Sequence[object]) -> None:
    """Every id a valid string and no id twice."""
    for v in values:
        check_id(name, v)
    if len(set(values)) != len(values):
        raise InvalidRequest(f"duplicate {name}s in one request")


def check_tokens(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest("token_ids must be a list of integers")
    return tuple(value)


def check_allocate_item(item: object) -> None:
    if not isinstance(item, dict):
        raise InvalidRequest("allocate item must be a mapping")
    check_id("seq_id", item.get("seq_id"))
    check_id("pool_id", item.get("pool_id"))
    check_tokens(item.get("token_ids"))
    num_tokens = item.get("num_tokens")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)):
        raise InvalidRequest("num_tokens must be an integer")
    check_optional_str("salt", item.get("salt"), 1024)


def append_requests(items: Sequence[object]) -> list[AppendRequest]:
    """`[seq_id, num_new_tokens, token_ids|null]` items → core requests (hot path).

    Only what the core cannot reject per item is checked here — the item shape and the id
    type (an unhashable id would fail mid-batch); counts and tokens are validated by the
    core, per item.
    """
    out: list[AppendRequest] = []
    add = out.append
    for item in items:
        if type(item) is not list or len(item) != 3:  # JSON arrays; the servicer builds lists
            raise InvalidRequest("append item must be [seq_id, num_new_tokens, token_ids|null]")
        sid, n, toks = item
        if type(sid) is not str or not 0 < len(sid) <= MAX_ID_LEN:
            raise InvalidRequest(f"seq_id must be a non-empty string of at most {MAX_ID_LEN} characters")
        if toks is not None and type(toks) is not list:
            raise InvalidRequest("token_ids must be a list of integers")
        add(AppendRequest(sid, n, None if toks is None else tuple(toks)))  # type: ignore[arg-type]
    return out


class CopyOpRecord(NamedTuple):
    """A copy op as results record it (a JSON array in the journal)."""

    op_id: int
    src: int
    dst: int
    kind: str


class AppendedRecord(NamedTuple):
    """One appended sequence of an `append_slots` result. A named tuple so the journal keeps
    the compact positional array (it is written once per sequence per scheduler step) while
    code reads fields by name; `decode_append_outcome` restores it after a JSON round trip."""

    seq_id: str
    slot_mapping: Sequence[int]
    new_block_ids: Sequence[int]
    copy_ops: Sequence[CopyOpRecord]
    version: int
    num_tokens: int


class ItemFailureRecord(NamedTuple):
    """One failed item of a batched result: which sequence, why (error class name), message."""

    seq_id: str
    reason: str
    message: str


def op_list(op: CopyOp) -> CopyOpRecord:
    return CopyOpRecord(op.op_id, op.src, op.dst, op.kind)


def decode_append_outcome(outcome: Any) -> AppendedRecord | ItemFailureRecord:
    """An `append_slots` outcome, fresh or read back from the journal, as a typed record."""
    if isinstance(outcome, dict):
        err = outcome["error"]
        return ItemFailureRecord(outcome["seq_id"], err["reason"], err["message"])
    if isinstance(outcome, AppendedRecord):
        return outcome
    seq_id, slots, new_blocks, ops, version, num_tokens = outcome
    return AppendedRecord(seq_id, slots, new_blocks, [CopyOpRecord(*op) for op in ops], version, num_tokens)


def allocation_dict(res: AllocateResult) -> dict[str, Any]:
    return {
        "seq_id": res.seq_id,
        "pool_id": res.pool_id,
        "block_table": list(res.block_table),
        "num_cached_tokens": res.num_cached_tokens,
        "slot_mapping": list(res.slot_mapping),
        "version": res.version,
    }


def append_outcome(res: AppendResult) -> AppendedRecord:
    """The journaled form of one appended sequence (tuples stay tuples: JSON writes arrays)."""
    ops = res.copy_ops
    return AppendedRecord(
        res.seq_id,
        res.slot_mapping,
        res.new_block_ids,
        [op_list(op) for op in ops] if ops else (),
        res.version,
        res.num_tokens,
    )


def table_dict(view: SequenceView) -> dict[str, Any]:
    return {
        "seq_id": view.seq_id,
        "pool_id": view.pool_id,
        "block_table": list(view.block_table),
        "num_tokens": view.num_tokens,
        "version": view.version,
    }


def plan_dict(plan: DefragPlan) -> dict[str, Any]:
    return {
        "plan_id": plan.plan_id,
        "pool_id": plan.pool_id,
        "kind": plan.kind,
        "moves": [op_list(m) for m in plan.moves],
    }


__all__ = [
    "AppendedRecord",
    "CopyOpRecord",
    "ItemFailureRecord",
    "allocation_dict",
    "decode_append_outcome",
    "append_outcome",
    "append_requests",
    "check_allocate_item",
    "check_count",
    "check_id",
    "check_ids",
    "check_optional_str",
    "check_tokens",
    "op_list",
    "plan_dict",
    "table_dict",
]
