"""A small decode workload driven through the step helper (shared by sync/async tests)."""

from __future__ import annotations

from block_manager.client.step import SeqSlots


def expected_server_steps(prompt_len: int, num_steps: int, block_size: int) -> int:
    """Decode steps (1 token per sequence, sequences in lockstep) that need AppendSlots:
    those whose append fills the last block or needs a new one."""
    return sum(1 for n in range(prompt_len, prompt_len + num_steps) if n % block_size in (0, block_size - 1))


def record(slots_by_seq: dict[str, list[int]], appends: dict) -> None:
    for sid, out in appends.items():
        assert isinstance(out, SeqSlots), out
        assert out.context_len == len(slots_by_seq[sid]) + len(out.slot_mapping)
        slots_by_seq[sid].extend(out.slot_mapping)


def check_against_tables(
    slots_by_seq: dict[str, list[int]], tables: dict[str, tuple[int, ...]], block_size: int
) -> None:
    """Every slot the client handed out (local or server) is where the server's table puts
    that token position."""
    for sid, slots in slots_by_seq.items():
        table = tables[sid]
        want = [table[p // block_size] * block_size + p % block_size for p in range(len(slots))]
        assert slots == want, sid
