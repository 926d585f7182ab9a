"""Fleet mode benchmark (issue 46): engines as `pagedkv-serve --block-manager` replicas over one
block manager and two compute nodes, all processes on this host (integration_tests/fleet_support.py
starts them as the integration test does; the nodes serve the demo's tiny random-weight Llama
unless --model-dir names another model directory).

(a) Throughput, two engines x one node each vs one engine x two nodes, side by side in one run:
    the same closed-loop workload (--requests distinct prompts, --concurrency clients, greedy,
    --max-tokens each) against one engine owning both nodes, then (a second engine joined, the
    block manager handing it one node) round-robin over two engines owning one node each, then
    one engine again (the second left gracefully). Tokens/s of each and the ratio.
(b) A prefix-heavy workload (--requests over --system-prompts shared system prompts of
    --system-len tokens, a short distinct question each) through `pagedkv-router` vs plain
    round-robin over the engines, fresh system prompts for each: the engines' prefix hit rate
    (prompt tokens cached / prompt tokens; fetched tokens count as cached, see the fetch
    column), tokens/s, and node-to-node fetched blocks per request.
(c) Adoption after SIGKILL: clients keep the engine to be killed and the survivor busy; from
    the kill, and from the moment the victim's lease lapses (its `remaining_s` in ListSchedulers
    just before the kill), to the block manager naming the survivor owner of the victim's node
    (a heartbeat of the survivor after the lapse) and to the survivor's first step on it (the
    node's first Generate answered OK after the kill).

Prints numbers, asserts nothing about time.

    .venv/bin/python bench/bench_fleet.py [--requests 64] [--max-tokens 32] [--concurrency 8]
        [--system-prompts 4] [--system-len 256] [--ttl 3] [--only a,b,c] [--json]
    .venv/bin/python bench/bench_fleet.py --requests 8 --max-tokens 4 --system-len 64   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from integration_tests.fleet_support import ENGINE_SERVICES, NODE_SERVICES, Fleet, Server, complete  # noqa: E402

ENGINES = ENGINE_SERVICES      # compose's api-server, api-server-2 (also their scheduler ids)
A, B = ENGINES


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 250) for _ in range(n)]


def _run(urls: list[str], model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, float]:
    """Send every prompt (prompt i to urls[i % len(urls)]), `concurrency` at a time; tokens/s."""
    def one(i: int) -> int:
        out = complete(urls[i % len(urls)], model, prompts[i], max_tokens, timeout_s=600)
        return len(out.tokens)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - start
    return {"requests": len(prompts), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def _engine_totals(engines: list[Server]) -> tuple[float, float]:
    return (sum(e.counter("pagedkv_prompt_tokens") for e in engines),
            sum(e.counter("pagedkv_prompt_tokens_cached") for e in engines))


def _fetched_blocks(fleet: Fleet) -> float:
    return sum(fleet.node_counter(n, "pagedkv_cn_fetched_blocks") for n in NODE_SERVICES)


def bench_throughput(fleet: Fleet, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    a = fleet.engines[A]
    fleet.wait_owners({A: 2}, timeout_s=args.ttl * 4 + 30)
    _run([a.url], fleet.model_name, [_prompt(rng, args.prompt_len) for _ in range(4)], 4, 4)   # warm-up

    def workload() -> list[list[int]]:
        return [_prompt(rng, args.prompt_len) for _ in range(args.requests)]

    one = _run([a.url], fleet.model_name, workload(), args.max_tokens, args.concurrency)
    b = fleet.start_engine(B)
    fleet.wait_owners({A: 1, B: 1}, timeout_s=args.ttl * 4 + 30)
    two = _run([a.url, b.url], fleet.model_name, workload(), args.max_tokens, args.concurrency)
    b.stop()                                            # SIGTERM: leaves the fleet after freeing
    del fleet.engines[B]
    fleet.wait_owners({A: 2}, timeout_s=args.ttl * 4 + 30)
    one_again = _run([a.url], fleet.model_name, workload(), args.max_tokens, args.concurrency)
    single = (one["tokens_per_s"] + one_again["tokens_per_s"]) / 2
    return {"one_engine_two_nodes": one, "two_engines_one_node_each": two, "one_engine_again": one_again,
            "ratio_two_over_one": two["tokens_per_s"] / single}


def bench_prefix_routing(fleet: Fleet, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    router = fleet.router
    if router is None:
        router = fleet.start_router()
    engines = [fleet.engines[name] for name in ENGINES]
    results: dict[str, Any] = {}
    for mode in ("round_robin", "router"):
        systems = [_prompt(rng, args.system_len) for _ in range(args.system_prompts)]
        prompts = [systems[i % len(systems)] + _prompt(rng, args.question_len) for i in range(args.requests)]
        rng.shuffle(prompts)
        urls = [router.url] if mode == "router" else [e.url for e in engines]
        prompt_before, cached_before = _engine_totals(engines)
        fetched_before = _fetched_blocks(fleet)
        run = _run(urls, fleet.model_name, prompts, args.max_tokens, args.concurrency)
        prompt_after, cached_after = _engine_totals(engines)
        fetched = _fetched_blocks(fleet) - fetched_before
        run["prefix_hit_rate"] = (cached_after - cached_before) / max(1.0, prompt_after - prompt_before)
        run["fetched_blocks_per_request"] = fetched / len(prompts)
        results[mode] = run
    results["router_metrics"] = {name: router.counter(f"pagedkv_router_{name}")
                                 for name in ("routed_by_prefix", "routed_by_load", "routed_by_balance", "retries")}
    return results


def bench_adoption(fleet: Fleet, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    survivor, victim = (fleet.engines[name] for name in ENGINES)
    owners = fleet.wait_owners({name: 1 for name in ENGINES}, timeout_s=args.ttl * 4 + 30)
    adopted = next(pool for pool, owner in owners.items() if owner == victim.name)
    stop = threading.Event()

    def load(url: str) -> None:
        while not stop.is_set():
            try:
                complete(url, fleet.model_name, _prompt(rng, 24), 8, timeout_s=60)
            except Exception:   # noqa: BLE001 - the victim's clients fail at the kill: keep loading the survivor
                if url == victim.url:
                    return
                time.sleep(0.05)

    clients = [threading.Thread(target=load, args=(url,), daemon=True)
               for url in (survivor.url, survivor.url, victim.url, victim.url)]
    for t in clients:
        t.start()
    time.sleep(1.0)
    with fleet.admin() as admin:
        left = next(m.remaining_s for m in admin.list_schedulers() if m.scheduler_id == victim.name)
    lapse = time.perf_counter() + left           # when its lease lapses, as the block manager said
    victim.kill()
    killed = time.perf_counter()
    forwards_before = fleet.node_counter(adopted, "pagedkv_cn_forwards", code="OK")   # none from the victim now
    owned_at: float | None = None
    stepped_at: float | None = None
    deadline = killed + args.ttl * 6 + 60
    while time.perf_counter() < deadline and (owned_at is None or stepped_at is None):
        if owned_at is None and fleet.owners().get(adopted) == survivor.name:
            owned_at = time.perf_counter()
        if stepped_at is None and fleet.node_counter(adopted, "pagedkv_cn_forwards", code="OK") > forwards_before:
            stepped_at = time.perf_counter()
        time.sleep(0.02)
    stop.set()
    for t in clients:
        t.join(timeout=120)

    def since(t0: float, t1: float | None) -> float | None:
        return None if t1 is None else t1 - t0

    return {"scheduler_lease_ttl_s": args.ttl, "lease_left_at_kill_s": lapse - killed,
            "kill_to_owned_s": since(killed, owned_at), "kill_to_first_step_s": since(killed, stepped_at),
            "lapse_to_owned_s": since(lapse, owned_at), "lapse_to_first_step_s": since(lapse, stepped_at)}


def _env(args: argparse.Namespace, workdir: Path) -> dict[str, str]:
    if args.model_dir is not None:
        model_dir = Path(args.model_dir).resolve()
    else:
        from compute_node.model.tiny import build_tiny_model
        from integration_tests.conftest import TEST_MODEL

        spec: dict[str, Any] = dict(TEST_MODEL)     # the integration tests' model
        model_dir = workdir / "models" / "tiny-llama"
        build_tiny_model(model_dir, **spec)
    return {"PAGEDKV_MODEL_DIR": str(model_dir.parent), "PAGEDKV_MODEL": model_dir.name,
            "PAGEDKV_CN_NUM_BLOCKS": str(args.num_blocks), "PAGEDKV_LOG_LEVEL": "WARNING"}


def _print(results: dict[str, Any]) -> None:
    if "throughput" in results:
        t = results["throughput"]
        print("(a) throughput, closed loop")
        for key in ("one_engine_two_nodes", "two_engines_one_node_each", "one_engine_again"):
            r = t[key]
            print(f"    {key:28s} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens']} tokens, {r['wall_s']:.1f} s)")
        print(f"    two engines / one engine (mean of both runs): {t['ratio_two_over_one']:.2f}x")
    if "prefix_routing" in results:
        p = results["prefix_routing"]
        print("(b) prefix-heavy workload")
        for mode in ("round_robin", "router"):
            r = p[mode]
            print(f"    {mode:12s} {r['tokens_per_s']:8.1f} tok/s  prefix hit rate {r['prefix_hit_rate']:.2f}  "
                  f"fetched blocks/request {r['fetched_blocks_per_request']:.2f}")
        print(f"    router counters: {p['router_metrics']}")
    if "adoption" in results:
        a = results["adoption"]

        def s(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.2f} s"

        print(f"(c) adoption after SIGKILL (scheduler lease {a['scheduler_lease_ttl_s']} s, "
              f"{a['lease_left_at_kill_s']:.2f} s of it left at the kill)")
        print(f"    kill -> owned by the survivor {s(a['kill_to_owned_s'])}, kill -> its first step there "
              f"{s(a['kill_to_first_step_s'])}")
        print(f"    lease lapse -> owned {s(a['lapse_to_owned_s'])}, lease lapse -> first step "
              f"{s(a['lapse_to_first_step_s'])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64, help="requests per workload (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight (default 8)")
    p.add_argument("--prompt-len", type=int, default=128, help="(a): prompt tokens (default 128)")
    p.add_argument("--system-prompts", type=int, default=4, help="(b): shared system prompts (default 4)")
    p.add_argument("--system-len", type=int, default=256, help="(b): tokens per system prompt (default 256)")
    p.add_argument("--question-len", type=int, default=16, help="(b): distinct tokens after it (default 16)")
    p.add_argument("--ttl", type=float, default=3.0, help="the block manager's scheduler lease, s (default 3)")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per node (default 4096)")
    p.add_argument("--model-dir", help="a model directory for the nodes (default: the tiny demo Llama)")
    p.add_argument("--only", default="a,b,c", help="which parts, comma-separated (default a,b,c)")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args()
    parts = set(args.only.split(","))
    rng = random.Random(46)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        workdir = Path(tmp)
        env = _env(args, workdir)
        fleet = Fleet(workdir / "fleet", env, ttl_s=args.ttl).up()
        try:
            fleet.start_engine(A)
            if "a" in parts:
                results["throughput"] = bench_throughput(fleet, args, rng)
            if B not in fleet.engines and parts & {"b", "c"}:
                fleet.start_engine(B)
                fleet.wait_owners({A: 1, B: 1}, timeout_s=args.ttl * 4 + 30)
            if "b" in parts:
                results["prefix_routing"] = bench_prefix_routing(fleet, args, rng)
            if "c" in parts:
                results["adoption"] = bench_adoption(fleet, args, rng)
        except BaseException:
            for name in fleet.stack.running:            # what the services said, before the directory goes
                print(f"--- {name} (last lines of its log)\n{fleet.stack.log_tail(name)}", file=sys.stderr)
            raise
        finally:
            fleet.down()
    _print(results)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
