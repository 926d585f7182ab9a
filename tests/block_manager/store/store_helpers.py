"""Helpers shared by the store tests (not a test module)."""

from __future__ import annotations

from block_manager.store import NewRecord, payload_digest


def make_record(request_id: str, op: str = "append_slots", num_seqs: int = 2) -> NewRecord:
    payload = {
        "requests": [{"seq_id": f"{request_id}-s{i}", "num_new_tokens": 1} for i in range(num_seqs)]
    }
    result = {"results": [{"seq_id": f"{request_id}-s{i}", "slot_mapping": (i * 16,)} for i in range(num_seqs)]}
    return NewRecord(request_id, op, payload, result, payload_digest(payload))


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
