"""Limits every service applies to the ids it accepts, in one place (the ground floor, so the
block manager and the compute nodes refuse the same ids with the same status).

A sequence id longer than `MAX_SEQ_ID_LEN` is refused as INVALID_ARGUMENT by the block manager
(`block_manager/service/state_codec.check_id`) and by a compute node (`compute_node.forward`,
`compute_node.generate`) before it does anything with it.
"""

from __future__ import annotations

MAX_SEQ_ID_LEN = 256


def seq_id_problem(seq_id: str) -> str | None:
    """Why `seq_id` is not a valid sequence id (None: it is)."""
    if not seq_id:
        return "is empty"
    if len(seq_id) > MAX_SEQ_ID_LEN:
        return f"has {len(seq_id)} characters (at most {MAX_SEQ_ID_LEN}): {seq_id[:32]!r}..."
    return None


__all__ = ["MAX_SEQ_ID_LEN", "seq_id_problem"]
