"""What a step costs the block manager (issue 21): one Step round trip at most, admissions
included (the block manager places them inside the Step), and the gauges ride on the Step
answer (each pool's free and usable blocks), so neither admitting nor `kv_usage` calls Route."""

from __future__ import annotations

import random
from typing import Any

from engine.params import SamplingParams
from tests.engine.fakes import VOCAB, fake_engine


def _count(client: Any, name: str, calls: list[str]) -> None:
    inner = getattr(client, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return inner(*args, **kwargs)

    setattr(client, name, counted)


def test_a_step_is_one_round_trip_and_kv_usage_comes_with_its_answer() -> None:
    engine, _ = fake_engine(2, num_blocks=256, block_size=16, max_num_batched_tokens=512)
    calls: list[str] = []
    for name in ("route", "route_many"):
        _count(engine.client, name, calls)
    rng = random.Random(3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(48):
        engine.add_request([rng.randrange(1, VOCAB) for _ in range(rng.randrange(20, 60))], params)
    usages = []
    per_step: list[tuple[int, bool]] = []     # (block manager RPCs, whether the step routed)
    while engine.has_unfinished_requests():
        before_rpcs, before_routes = engine.stats.num_bm_rpcs, len(calls)
        engine.step()
        per_step.append((engine.stats.num_bm_rpcs - before_rpcs, len(calls) > before_routes))
        routes_so_far = len(calls)
        usages.append(engine.kv_usage())
        assert len(calls) == routes_so_far          # reading the gauge called nothing
    assert max(usages) > 0.1 and 0.0 <= min(usages) and max(usages) <= 1.0
    assert calls == []                                # no Route: placement happens inside the Step
    # the first step also commits the second's Step (async scheduling fills its pipeline)
    assert per_step[0][0] <= 2 and max(n for n, _ in per_step[1:]) == 1, per_step
    engine.flush()
    assert engine.kv_usage() == 0.0                   # everything freed, as the flush's answer says


def test_placement_inside_the_step_spreads_prompts_and_follows_prefix_hits() -> None:
    """Eight new prompts in one step go to both nodes (free blocks, charged per step); a prompt
    sharing a cached prefix goes where the prefix is, and the budget admits what it can."""
    engine, nodes = fake_engine(2, num_blocks=256, block_size=16, max_num_batched_tokens=4096)
    rng = random.Random(4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(64)] for _ in range(8)]
    for p in prompts:
        engine.add_request(p, params)
    engine.step()
    assert len(engine.running) == 8 and {s.node_id for s in engine.running} == {"fake-0", "fake-1"}
    first = {s.request.prompt_token_ids[0]: s.node_id for s in engine.running}
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    again = prompts[3][:48] + [rng.randrange(1, VOCAB) for _ in range(16)]   # 3 cached blocks
    rid = engine.add_request(again, params)
    engine.step()
    (seq,) = engine.running
    assert seq.node_id == first[prompts[3][0]] and engine.requests[rid].num_cached_tokens == 48
    # a budget of 100 tokens admits one 64-token prompt and refuses nothing it cannot
    # (one Step's admissions: without async scheduling, whose first step also plans the second)
    small, _ = fake_engine(2, num_blocks=256, block_size=16, max_num_batched_tokens=100, async_scheduling=False)
    for p in prompts[:4]:
        small.add_request(p, params)
    small.step()
    assert len(small.running) == 2 and len(small.waiting) == 2   # 64 + the first 36 of the next
