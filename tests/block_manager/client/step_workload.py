"""Helpers of the step tests: a scheduler loop's bookkeeping (shared by sync/async tests)."""

from __future__ import annotations

from block_manager.client.step import StepResult
from block_manager.client.types import SeqSlots


def forwarded(client, result: StepResult) -> StepResult:  # type: ignore[no-untyped-def]
    """Each pool's Forward ran (nothing to run in these tests): report it with the next step."""
    for pool_step in result.steps.values():
        client.report(pool_step, ok=True)
    return result


def expected_server_steps(prompt_len: int, num_steps: int, block_size: int) -> int:
    """Decode steps (1 token per sequence, sequences in lockstep) that need a Step RPC: those
    whose append fills the last block or needs a new one."""
    return sum(1 for n in range(prompt_len, prompt_len + num_steps) if n % block_size in (0, block_size - 1))


def record(client, slots_by_seq: dict[str, list[int]], appends: dict) -> None:  # type: ignore[no-untyped-def]
    """The slots each appended sequence's Forward writes, from the client's mirrored table."""
    for sid, out in appends.items():
        assert isinstance(out, SeqSlots), out
        assert out.context_len == len(slots_by_seq[sid]) + out.num_new_tokens
        t = client.tracker.get(sid)
        slots_by_seq[sid].extend(t.slot_mapping(out.context_len - out.num_new_tokens, out.context_len))


def check_against_tables(
    slots_by_seq: dict[str, list[int]], tables: dict[str, tuple[int, ...]], block_size: int
) -> None:
    """Every slot the client's tables handed out (local or server) is where the server's table
    puts that token position."""
    for sid, slots in slots_by_seq.items():
        table = tables[sid]
        want = [table[p // block_size] * block_size + p % block_size for p in range(len(slots))]
        assert slots == want, sid
