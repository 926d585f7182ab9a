"""What a step costs the block manager (issue 21): the gauges ride on the Step answer (each
pool's free and usable blocks), so `kv_usage` never calls Route; a step makes at most one Step
round trip, plus one Route only while it admits."""

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


def test_kv_usage_comes_with_the_step_answer_and_steps_cost_one_step_rpc() -> None:
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
    assert all(n <= 1 + routed for n, routed in per_step), per_step
    assert sum(n for n, routed in per_step if not routed) <= len([1 for _, r in per_step if not r])
    engine.flush()
    assert engine.kv_usage() == 0.0                   # everything freed, as the flush's answer says
