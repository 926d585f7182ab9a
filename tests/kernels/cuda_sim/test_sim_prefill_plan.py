"""`PrefillPlan` / `SlotWritePlan` (kernels/cuda/prefill_plan.py) in the simulator.

Two layers of one step (the same tables, other values): the plans' writes and attention must
be bit for bit what the public `write_slots` + `paged_prefill_attention` produce (the same
kernels, launched with pre-bound arguments), and within tolerance of the float64 reference;
the arguments are validated once per step, not per layer; a later call that does not match
the first is refused.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sim_cases import assert_close, make_case, queries

import kernels
from kernels import _validate, reference
from kernels._validate import KernelInputError
from kernels.cuda.prefill_plan import PrefillPlan, SlotWritePlan

KV_HEADS, GROUP, BLOCK, HEAD_DIM = 1, 2, 4, 16
Q_LENS, LENS = [5, 3], [13, 6]


def _step(rng: np.random.Generator):
    first = make_case(rng, LENS, num_kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM)
    second = copy.deepcopy(first)
    for cache in (second.key_cache, second.value_cache):
        used = ~np.isnan(cache)
        cache[used] = rng.standard_normal(int(used.sum())).astype(cache.dtype)
    positions = [p for n, q in zip(LENS, Q_LENS) for p in range(n - q, n)]
    seqs = [s for s, q in enumerate(Q_LENS) for _ in range(q)]
    slots = np.array([first.block_tables[s, p // BLOCK] * BLOCK + p % BLOCK for s, p in zip(seqs, positions)],
                     dtype=np.int64)
    return [first, second], torch.from_numpy(slots)


def test_plans_match_the_public_calls_bitwise_and_validate_once(monkeypatch) -> None:
    rng = np.random.default_rng(43)
    cases, slots = _step(rng)
    total = sum(Q_LENS)
    starts = torch.tensor(np.concatenate([[0], np.cumsum(Q_LENS)]), dtype=torch.int32)
    tables, lens = torch.from_numpy(cases[0].block_tables), torch.from_numpy(cases[0].seq_lens)
    q = [torch.from_numpy(queries(rng, (total, KV_HEADS * GROUP, HEAD_DIM), np.float16)) for _ in cases]
    kv = [torch.from_numpy(queries(rng, (total, KV_HEADS, HEAD_DIM), np.float16) / 3) for _ in range(4)]
    caches = {path: [(torch.from_numpy(c.key_cache.copy()), torch.from_numpy(c.value_cache.copy())) for c in cases]
              for path in ("plan", "api")}
    checks = {"prefill": 0, "write": 0}
    def counting(name: str, fn):
        def counted(*args, **kwargs):
            checks[name] += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(_validate, "check_prefill", counting("prefill", _validate.check_prefill))
    monkeypatch.setattr(_validate, "check_write_slots", counting("write", _validate.check_write_slots))
    plan = PrefillPlan(tables, lens, starts, cases[0].scale, max_query_len=max(Q_LENS))
    writes = SlotWritePlan(slots)
    outs = {}
    for layer in range(2):
        kc, vc = caches["plan"][layer]
        writes.write(kv[2 * layer], kv[2 * layer + 1], kc, vc)
        outs[("plan", layer)] = plan.attend(q[layer], kc, vc, torch.full_like(q[layer], float("nan")))
    assert checks == {"prefill": 1, "write": 1}   # once per step, not per layer
    assert plan.num_launches == 2 and writes.num_launches == 2
    for layer in range(2):
        kc, vc = caches["api"][layer]
        kernels.write_slots(kv[2 * layer], kv[2 * layer + 1], kc, vc, slots, backend="cuda")
        outs[("api", layer)] = kernels.paged_prefill_attention(
            q[layer], kc, vc, tables, lens, starts, cases[0].scale, out=torch.full_like(q[layer], float("nan")),
            backend="cuda", max_query_len=max(Q_LENS))
    for layer in range(2):
        for a, b in zip(caches["plan"][layer], caches["api"][layer], strict=True):
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        assert torch.equal(outs[("plan", layer)], outs[("api", layer)])
        k_np, v_np = (c.numpy() for c in caches["plan"][layer])
        ref = reference.paged_prefill_attention(q[layer].numpy(), k_np, v_np, cases[0].block_tables,
                                                cases[0].seq_lens, starts.numpy(), cases[0].scale)
        assert_close(outs[("plan", layer)].numpy(), ref, 2e-3)


def test_a_later_call_must_match_the_first_and_the_first_is_fully_validated() -> None:
    rng = np.random.default_rng(44)
    cases, slots = _step(rng)
    total = sum(Q_LENS)
    kc, vc = torch.from_numpy(cases[0].key_cache), torch.from_numpy(cases[0].value_cache)
    starts = torch.tensor([0, 5, 8], dtype=torch.int32)
    tables, lens = torch.from_numpy(cases[0].block_tables), torch.from_numpy(cases[0].seq_lens)
    q = torch.from_numpy(queries(rng, (total, KV_HEADS * GROUP, HEAD_DIM), np.float16))
    with pytest.raises(KernelInputError, match="max_query_len 4 is below the longest chunk"):
        PrefillPlan(tables, lens, starts, cases[0].scale, max_query_len=4).attend(q, kc, vc, torch.empty_like(q))
    plan = PrefillPlan(tables, lens, starts, cases[0].scale)   # the longest chunk from host starts
    plan.attend(q, kc, vc, torch.empty_like(q))
    with pytest.raises(KernelInputError, match="first call"):
        plan.attend(q.float(), kc, vc, torch.empty_like(q))
    with pytest.raises(KernelInputError, match="first call"):
        plan.attend(q, kc, vc, torch.empty_like(q, dtype=torch.float32))
    wide = torch.empty((total, KV_HEADS * GROUP, 2 * HEAD_DIM), dtype=torch.float16)
    with pytest.raises(KernelInputError, match="C-contiguous"):
        plan.attend(wide[:, :, :HEAD_DIM], kc, vc, torch.empty_like(q))
    k = torch.zeros((total, KV_HEADS, HEAD_DIM), dtype=torch.float16)
    with pytest.raises(KernelInputError, match="duplicate"):
        SlotWritePlan(torch.cat([slots[:-1], slots[:1]])).write(k, k, kc, vc)
    writes = SlotWritePlan(slots)
    writes.write(k, k, kc, vc)
    with pytest.raises(KernelInputError, match="first call"):
        writes.write(k[:-1], k[:-1], kc, vc)
