"""Host KV tier benchmark (issue 18, docs/tiers.md): CPU, float32, a small random-weight Llama
built in a temp dir, the embedded `LLM`; each comparison runs side by side in one process.

1. Preemption-heavy: device pool at ~50% of the working set; swap vs recompute preemption:
   tokens/s, preemptions, recomputed tokens, p99 inter-token latency.
2. Prefix-heavy: `--systems` system prompts whose blocks are 4x the device pool, requested in
   rounds with fresh tails: prefix-hit tokens (device + host) with a host tier vs without vs an
   infinite device cache; and TTFT of one long-prefix request whose prefix is on host (onboard)
   vs recomputed.
3. Tier move cost: device<->host per block, batched (one gather + transfer per layer) vs one
   block per call, for this model's block geometry.
4. The block manager core's step (append + close + settle over a decode batch) with tier ops
   (a swap-out and a swap-in every few steps) vs without.

    .venv/bin/python bench/bench_tiers.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from block_manager.core import BlockManager  # noqa: E402
from compute_node.host_pool import HostKvPool  # noqa: E402
from compute_node.model.tiny import build_tiny_model  # noqa: E402
from compute_node.pool import KvPool, PoolGeometry  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

BS = 16
MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
             vocab_size=2048)


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1, 2000) for _ in range(length)] for _ in range(n)]


def preemption_heavy(model: Path, n: int, prompt_len: int, out_len: int, prefix_caching: bool = True) -> None:
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": p} for p in _prompts(rng, n, prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    working = n * -(-(prompt_len + out_len) // BS)
    device = working // 2
    print(f"## preemption-heavy: {n} requests x ({prompt_len} prompt + {out_len} output) tokens, working set "
          f"{working} blocks of {BS}, device pool {device} blocks, prefix caching {'on' if prefix_caching else 'off'}")
    results = {}
    for mode in ("recompute", "swap", "recompute", "swap"):
        host = 2 * working if mode == "swap" else None
        with LLM(model, block_size=BS, num_kv_blocks=device, device="cpu", watermark=0.0, host_kv_blocks=host,
                 preemption_mode=mode, max_num_batched_tokens=512, enable_prefix_caching=prefix_caching) as llm:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            s = llm.stats()
        toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
        row = (toks / dt, s["preemptions"], s["recomputed_tokens"], s["itl_p99_ms"], s["swapped_out_blocks"], dt)
        if mode not in results or row[0] > results[mode][0]:
            results[mode] = row
    for mode, (tps, pre, rec, itl, swapped, dt) in results.items():
        print(f"{mode:9s}: {tps:7.1f} tok/s  preemptions {pre:4d}  recomputed tokens {rec:6d}  "
              f"p99 ITL {itl:7.1f} ms  swapped-out blocks {swapped:5d}  ({dt:.1f} s)")
    print(f"swap / recompute throughput {results['swap'][0] / results['recompute'][0]:.2f}x, "
          f"p99 ITL {results['swap'][3] / max(results['recompute'][3], 1e-9):.2f}x")


def prefix_heavy(model: Path, systems: int, system_len: int, rounds: int) -> None:
    rng = random.Random(2)
    sys_prompts = _prompts(rng, systems, system_len)
    hot = systems * (system_len // BS)
    device = hot // 4 + 8
    reqs = [{"prompt_token_ids": s + t} for _ in range(rounds) for s, t in zip(sys_prompts, _prompts(rng, systems, 8))]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    print(f"## prefix-heavy: {systems} system prompts x {system_len} tokens (hot set {hot} blocks), {rounds} rounds, "
          f"device pool {device} blocks")
    rows = {}
    for label, dev, host in (("no host tier", device, None), (f"host tier {2 * hot}", device, 2 * hot),
                             ("infinite device cache", 4 * hot, None)):
        with LLM(model, block_size=BS, num_kv_blocks=dev, device="cpu", watermark=0.0, host_kv_blocks=host,
                 max_num_seqs=4, max_num_batched_tokens=1024) as llm:
            t0 = time.perf_counter()
            llm.generate(reqs, params)
            dt = time.perf_counter() - t0
            s = llm.stats()
        rows[label] = (s["prefix_hit_tokens"], s["host_hit_tokens"], dt)
    inf = rows["infinite device cache"][0] + rows["infinite device cache"][1]
    for label, (dev_hits, host_hits, dt) in rows.items():
        print(f"{label:22s}: device hits {dev_hits:6d}  host hits {host_hits:6d}  total "
              f"{100 * (dev_hits + host_hits) / max(inf, 1):5.1f}% of the infinite cache's  ({len(reqs)} requests "
              f"in {dt:.1f} s, {len(reqs) / dt:.2f} req/s)")


def ttft_host_hit(model: Path, prefix_len: int) -> None:
    """One long-prefix request, its prefix evicted from the device by other prompts: onboarded
    from host vs recomputed (TTFT = a 1-token generate)."""
    rng = random.Random(3)
    prefix = _prompts(rng, 1, prefix_len)[0]
    fillers = [{"prompt_token_ids": p} for p in _prompts(rng, 4, prefix_len)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    device = prefix_len // BS + 8
    out = {}
    for label, host in (("recompute", None), ("host hit", 8 * device)):
        times = []
        for rep in range(3):
            with LLM(model, block_size=BS, num_kv_blocks=device, device="cpu", watermark=0.0, host_kv_blocks=host,
                     max_num_batched_tokens=4096) as llm:
                llm.generate([{"prompt_token_ids": prefix + [7]}], one)     # cache the prefix
                llm.generate(fillers, one)                                  # evict it (offload with a host tier)
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prefix + [9, rep + 10]}], one)
                times.append(time.perf_counter() - t0)
                s = llm.stats()
        out[label] = (min(times), s["host_hit_tokens"])
    print(f"## TTFT, {prefix_len}-token prefix evicted from the device: recompute {1e3 * out['recompute'][0]:.1f} ms, "
          f"host hit {1e3 * out['host hit'][0]:.1f} ms (host hit tokens {out['host hit'][1]}): "
          f"{out['recompute'][0] / out['host hit'][0]:.1f}x")


def move_cost(n_blocks: int) -> None:
    g = PoolGeometry(MODEL["num_layers"], MODEL["num_kv_heads"], MODEL["head_dim"], "float32", BS, 4 * n_blocks)
    pool = KvPool(g, torch.device("cpu"))
    host = HostKvPool(g, 4 * n_blocks, torch.device("cpu"))
    pairs = [(i * 3 % (4 * n_blocks), i) for i in range(n_blocks)]

    def timed(fn, reps: int = 5) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    batched_out = timed(lambda: host.to_host(pool, pairs)) / n_blocks
    batched_in = timed(lambda: host.to_device(pool, [(d, s) for s, d in pairs])) / n_blocks
    single = timed(lambda: [host.to_host(pool, [p]) for p in pairs]) / n_blocks
    print(f"## tier move cost, {g.bytes_per_block / 1024:.0f} KiB per block ({g.num_layers} layers): batched "
          f"{n_blocks} blocks/step device->host {1e6 * batched_out:.1f} us/block, host->device "
          f"{1e6 * batched_in:.1f} us/block; one block per call {1e6 * single:.1f} us/block "
          f"({single / batched_out:.1f}x)")


def core_step(num_seqs: int, steps: int, swap_every: int) -> None:
    def run(with_tiers: bool) -> float:
        m = BlockManager(watermark=0.0)
        blocks = num_seqs * -(-(40 + steps) // BS) + 8
        m.add_pool("p", blocks, BS, host_num_blocks=blocks)
        ids = [f"s{i}" for i in range(num_seqs)]
        for sid in ids:
            m.allocate(sid, "p", list(range(1, 40)))
        out = m.close_step("p")
        m.settle_steps("p", out.step_id)
        live = list(ids)
        swapped: list[str] = []
        t0 = time.perf_counter()
        for step in range(steps):
            if with_tiers and step % swap_every == 0:
                if swapped:
                    m.swap_in(swapped)
                    live += swapped
                    swapped = []
                else:
                    victim = [live.pop()]
                    m.swap_out(victim)
                    swapped = victim
            m.append_tokens(live, [1] * len(live), list(range(len(live))))
            out = m.close_step("p")
            m.settle_steps("p", out.step_id)
        return (time.perf_counter() - t0) / steps

    base = min(run(False) for _ in range(3))
    tiers = min(run(True) for _ in range(3))
    print(f"## core step, {num_seqs} decoding sequences: {1e6 * base:.0f} us without tier ops, {1e6 * tiers:.0f} us "
          f"with a swap-out or swap-in every {swap_every} steps ({tiers / base:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (CI smoke)")
    args = ap.parse_args()
    torch.manual_seed(0)
    q = args.quick
    print(f"# bench_tiers  torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "llama", "llama", seed=1, **MODEL)
        preemption_heavy(model, 8 if q else 16, 64, 32 if q else 64)
        preemption_heavy(model, 8 if q else 16, 64, 32 if q else 64, prefix_caching=False)
        prefix_heavy(model, 8 if q else 16, 128 if q else 256, 2 if q else 3)
        ttft_host_hit(model, 512 if q else 2048)
    move_cost(64)
    core_step(64 if q else 256, 50 if q else 200, 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
