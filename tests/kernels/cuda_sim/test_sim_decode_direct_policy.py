"""The direct decode launch partitions from the host lengths it is given (issue 43), in the simulator.

A decode step that does not replay graphs (graphs off, or a fallback) launches
`kernels.paged_attention_decode` per layer with device lengths, which the split policy cannot
read without a synchronisation: it would take every sequence at the tables' capacity. The
node passes the host copy it built (`host_seq_lens`) through `KvPool.decode`, and the policy
partitions from it (no split below the threshold, a ragged batch cut by a common chunk size).
Here torch tensors stand for device memory (`decode_split.to_host_numpy` cannot read them),
so the partitions can only come from `host_seq_lens`; the controls show the capacity rule
picks otherwise. Sizes as `test_sim_decode_path_policy.py` (64-token partitions, no split
below 128 tokens, a pretend GPU of 8 resident blocks); outputs against the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries

import kernels
from compute_node.decode_path import StepShape
from compute_node.pool import KvPool, PoolGeometry
from kernels import KernelInputError, reference
from kernels.cuda import decode, decode_policy, decode_split
from kernels.cuda._host import spec_for

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 16, 8
CPU = torch.device("cpu")
OCCUPANCY = decode_policy.Occupancy(8, 8)


@pytest.fixture
def chosen(monkeypatch) -> list:
    """The partitions each direct launch chose (None: the one-pass kernel)."""
    monkeypatch.setattr(decode_policy, "MIN_PART_TOKENS", 64)
    monkeypatch.setattr(decode_policy, "MIN_SPLIT_TOKENS", 128)
    monkeypatch.setattr(decode, "resident_blocks", lambda spec: OCCUPANCY)

    def device_lengths_unreadable(x):  # a torch tensor stands for a CUDA tensor here
        return None if isinstance(x, torch.Tensor) else np.asarray(x)

    monkeypatch.setattr(decode_split, "to_host_numpy", device_lengths_unreadable)
    seen: list = []
    parts_for = decode_split.parts_for

    def spy(*args, **kwargs):
        parts = parts_for(*args, **kwargs)
        seen.append(None if parts is None else parts.tolist())
        return parts

    monkeypatch.setattr(decode_split, "parts_for", spy)
    return seen


def _policy(lens: np.ndarray) -> list[int] | None:
    spec = spec_for(HEAD_DIM, BLOCK, KV_HEADS, HEADS // KV_HEADS, "f16", "f16", "f16", "decode")
    heads_grid = spec.num_kv_heads * spec.row_blocks
    parts = decode_policy.split_parts(np.asarray(lens, np.int64), heads_grid, OCCUPANCY)
    return None if parts is None else parts.tolist()


def _case(lens: list[int]):
    case = make_case(np.random.default_rng(5), lens, num_kv_heads=KV_HEADS, block_size=BLOCK,
                     head_dim=HEAD_DIM)
    return case, queries(np.random.default_rng(6), (len(lens), HEADS, HEAD_DIM), np.float16)


# (rows of the case, split-K expected): ragged with one long sequence; all below 128 tokens
@pytest.mark.parametrize("graphs", [False, True], ids=["graphs_off", "fallback"])
def test_the_direct_path_partitions_from_host_lengths(chosen, graphs: bool) -> None:
    case, q = _case([300, 40, 70])
    width = case.block_tables.shape[1]
    geometry = PoolGeometry(1, KV_HEADS, HEAD_DIM, "float16", BLOCK, case.key_cache.shape[0])
    # with graphs on, a context limit below the tables' width makes every step fall back
    pool = KvPool(geometry, CPU, cuda_graphs=graphs, max_context=BLOCK if graphs else width * BLOCK,
                  backend="cuda")
    pool.key_caches[0].copy_(torch.from_numpy(case.key_cache))
    pool.value_caches[0].copy_(torch.from_numpy(case.value_cache))
    shape = StepShape(HEADS, torch.float16, float(case.scale))
    capacity = np.full(3, width * BLOCK)
    for rows, split in (([0, 1, 2], True), ([1, 2], False)):
        tables, lens = case.block_tables[rows], case.seq_lens[rows]
        expected = _policy(lens)
        assert (expected is not None) is split
        control = _policy(capacity[: len(rows)])
        assert control is not None and control != expected  # the capacity rule splits alike
        step = pool.begin_decode(torch.from_numpy(tables), torch.from_numpy(lens), shape,
                                 host_seq_lens=lens)
        assert not step.graphed
        chosen.clear()
        out = step.run(0, torch.from_numpy(q[rows]))
        assert chosen == [expected]
        if split:
            assert expected is not None and expected[0] > expected[1] == expected[2] == 1
        ref = reference.paged_attention_decode(q[rows], case.key_cache, case.value_cache, tables,
                                               lens, case.scale)
        assert_close(out.numpy(), ref, 1e-3)
        # control: the same launch without host lengths partitions at the capacity
        chosen.clear()
        pool.decode(0, torch.from_numpy(q[rows]), torch.from_numpy(tables), torch.from_numpy(lens),
                    float(case.scale))
        assert chosen == [control]
    if graphs:
        assert pool.decode_path.stats.counts() == {"graph": 0, "fallback_table_width": 2}


def test_host_lengths_are_validated(chosen) -> None:
    case, q = _case([300, 40, 70])
    args = (q, case.key_cache, case.value_cache, case.block_tables, torch.from_numpy(case.seq_lens),
            case.scale)
    capacity = case.block_tables.shape[1] * BLOCK
    for bad in (case.seq_lens[:2], case.seq_lens.astype(np.float32), case.seq_lens + [0, 1, 0],
                np.array([300, 0, 70]), np.array([capacity + 1, 40, 70])):
        with pytest.raises(KernelInputError, match="host_seq_lens"):
            kernels.paged_attention_decode(*args, backend="cuda", host_seq_lens=bad)
    assert chosen == []  # nothing launched
