"""Engine benchmark (issue 21): block manager round trips per engine step, and what a dead
node costs.

1. RPCs per step: an engine over the in-process block manager (the same protocol and code path
   as over gRPC, only the transport differs) and two fake nodes (no model: tokens are a pure
   function of the input), a steady stream of admissions (`--requests` prompts of 64-512
   tokens arriving `--per-step` per step), 32 generated tokens each. Counted: Step round trips
   and Route calls per step, split into steps that admitted and steps that did not, and the
   Route calls `kv_usage` makes (the gauge read once per step, as the API server's scrape
   would).
2. A dead node: the same engine, node 1 stops answering (unreachable) mid-run: failed node
   steps, and seconds until every request it held completed on node 0.

    .venv/bin/python bench/bench_engine_rpcs.py [--requests 400] [--per-step 8]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.params import SamplingParams  # noqa: E402
from tests.engine.fakes import VOCAB, fake_engine  # noqa: E402


def rpcs_per_step(num_requests: int, per_step: int) -> None:
    engine, _ = fake_engine(2, num_blocks=8192, block_size=16, max_num_batched_tokens=2048)
    routes = [0]
    for name in ("route", "route_many"):
        inner = getattr(engine.client, name)

        def counted(*a, _inner=inner, **k):  # type: ignore[no-untyped-def]
            routes[0] += 1
            return _inner(*a, **k)

        setattr(engine.client, name, counted)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(64, 513))] for _ in range(num_requests)]
    admitting = {"steps": 0, "rpcs": 0, "routes": 0}
    other = {"steps": 0, "rpcs": 0, "routes": 0}
    gauge_routes = 0
    started = time.perf_counter()
    while prompts or engine.has_unfinished_requests():
        for p in prompts[:per_step]:
            engine.add_request(p, params)
        del prompts[:per_step]
        rpcs, r0 = engine.stats.num_bm_rpcs, routes[0]
        waiting_before = len(engine.waiting)
        engine.step()
        admitted = len(engine.waiting) < waiting_before
        side = admitting if admitted else other
        side["steps"] += 1
        side["rpcs"] += engine.stats.num_bm_rpcs - rpcs
        side["routes"] += routes[0] - r0
        r1 = routes[0]
        engine.kv_usage()
        gauge_routes += routes[0] - r1
    elapsed = time.perf_counter() - started
    print(f"## RPCs per step ({num_requests} requests, {per_step} arriving per step, 2 fake nodes, {elapsed:.1f} s)")
    print("| steps | count | block manager RPCs / step | of which Route / step |")
    print("|---|---:|---:|---:|")
    for name, side in (("admitting", admitting), ("not admitting", other)):
        n = max(1, side["steps"])
        print(f"| {name} | {side['steps']} | {side['rpcs'] / n:.2f} | {side['routes'] / n:.2f} |")
    print(f"Route calls made by kv_usage (read once per step): {gauge_routes}")
    engine.close()


def dead_node(num_requests: int) -> None:
    engine, nodes = fake_engine(2, num_blocks=4096, block_size=16, max_num_batched_tokens=2048)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(1, VOCAB) for _ in range(rng.randrange(32, 256))], params)
    while not any(s.node_id == "fake-1" and s.num_output_tokens > 4 for s in engine.running):
        engine.step()
    held = {s.request.request_id for s in engine.running if s.node_id == "fake-1"}
    nodes["fake-1"].dead = True
    killed = time.perf_counter()
    done: set[str] = set()
    while not held <= done:
        done |= {o.request_id for o in engine.step() if o.finished}
    print(f"## A dead node: {len(held)} requests on it; all completed on the other node "
          f"{time.perf_counter() - killed:.3f} s after it stopped answering; failed node steps: "
          f"{nodes['fake-1'].num_failed}")
    engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--per-step", type=int, default=8)
    args = parser.parse_args()
    rpcs_per_step(args.requests, args.per_step)
    dead_node(64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
