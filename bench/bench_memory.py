"""Memory benchmarks of the core on generated traces (issue 2).

    .venv/bin/python bench/bench_memory.py [--requests 600] [--only waste,fork,prefix,sweep]

Sections (each prints a markdown table):
- waste: internal waste and concurrency at equal memory vs contiguous preallocation;
- fork: parallel sampling n=4 with fork/CoW vs 4 independent allocations;
- prefix: prefix-cache hit tokens vs the trace's theoretical maximum;
- sweep: block sizes 8..128 on one trace.

Every replay runs on a fresh core; all numbers of a table come from the same run of this
script, so ratios are comparable even on a noisy shared machine.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

from block_manager.trace.generate import TraceConfig, generate_trace
from block_manager.trace.replay import ReplayReport, replay

POOL_SLOTS = 1 << 20  # big enough that no section rejects anything unless it says so


def _trace(config: TraceConfig) -> list[str]:
    return list(generate_trace(config))


def _pool(block_size: int, slots: int = POOL_SLOTS) -> int:
    return slots // block_size


# ---- waste and concurrency ---------------------------------------------------------------
def section_waste(num_requests: int) -> None:
    config = TraceConfig(
        num_requests=num_requests, seed=2, shared_prompt_fraction=0.0, parallel_fraction=0.0,
        arrival_rate=4.0, max_running=256,
    )
    lines = _trace(config)
    print(f"## waste and concurrency at equal memory ({num_requests} requests, mixed lengths, no sharing)\n")
    print("prompt 50-1000, output 50-2000 tokens (log-uniform); block size 16; prefix caching off.\n")
    print("| contiguous baseline reserves per sequence | paged waste | contiguous waste | concurrency gain |")
    print("|---|---|---|---|")
    baselines: list[tuple[str, dict[str, int]]] = [
        ("its exact final length (oracle)", {}),
        ("prompt + max output (2000)", {"max_output_len": 2000}),
        ("max_model_len = 3000", {"max_model_len": 3000}),
    ]
    for label, knobs in baselines:
        r = replay(lines, num_blocks=_pool(16), block_size=16, enable_prefix_caching=False, **knobs)
        _check_clean(r)
        print(f"| {label} | {r.waste_ratio:.2%} | {r.contiguous_waste_ratio:.1%} | {r.concurrency_gain:.2f}x |")
    print(
        "\nconcurrency gain = mean over append steps of the contiguous reservation of the live "
        "sequences / mean paged allocated slots (same live sequences): how many more sequences "
        "fit in the same number of token slots. contiguous waste = reserved slots holding no token "
        "(mean over steps).\n"
    )


# ---- parallel sampling ---------------------------------------------------------------------
def independent_allocations(lines: list[str]) -> Iterator[str]:
    """The same trace with every fork replaced by allocations of the parent's prompt."""
    prompts: dict[str, tuple[list[int], str | None]] = {}
    for line in lines:
        op = json.loads(line)
        if op["op"] == "allocate":
            prompts[op["seq"]] = (op["tokens"], op.get("salt"))
        if op["op"] != "fork":
            yield line
            continue
        tokens, salt = prompts[op["parent"]]
        for child in op["children"]:
            alloc: dict[str, object] = {"op": "allocate", "seq": child, "tokens": tokens}
            if salt is not None:
                alloc["salt"] = salt
            yield json.dumps(alloc, separators=(",", ":"))


def section_fork(num_requests: int) -> None:
    print(f"## parallel sampling n=4: fork/CoW vs 4 independent allocations ({num_requests} requests)\n")
    print("Every request samples 4 continuations; prefix caching off on both sides; block size 16.\n")
    print(
        "| length mix | peak blocks fork | peak blocks independent | saved (peak) | mean blocks fork "
        "| mean blocks independent | saved (mean) | CoW copies |"
    )
    print("|---|---|---|---|---|---|---|---|")
    mixes = [
        ("chat: prompt 50-1000, output 50-2000", dict()),
        ("long prompt: prompt 500-4000, output 50-500", dict(prompt_len_min=500, prompt_len_max=4000,
                                                             output_len_min=50, output_len_max=500)),
    ]
    for label, knobs in mixes:
        config = TraceConfig(
            num_requests=num_requests, seed=3, shared_prompt_fraction=0.0, parallel_fraction=1.0,
            parallel_n=4, arrival_rate=1.0, max_running=256, **knobs,  # type: ignore[arg-type]
        )
        lines = _trace(config)
        forked = replay(lines, num_blocks=_pool(16), block_size=16, enable_prefix_caching=False)
        indep = replay(list(independent_allocations(lines)), num_blocks=_pool(16), block_size=16,
                       enable_prefix_caching=False)
        _check_clean(forked)
        _check_clean(indep)
        print(
            f"| {label} | {forked.peak_used_blocks} | {indep.peak_used_blocks} | "
            f"{1 - forked.peak_used_blocks / indep.peak_used_blocks:.1%} | {forked.mean_used_blocks:.0f} | "
            f"{indep.mean_used_blocks:.0f} | {1 - forked.mean_used_blocks / indep.mean_used_blocks:.1%} | "
            f"{forked.cow_copies} |"
        )
    print()


# ---- prefix caching ------------------------------------------------------------------------
def theoretical_prefix_hits(lines: list[str], block_size: int) -> int:
    """Upper bound of prefix-cache hit tokens for a trace, with an infinite cache.

    For each allocate in trace order: the longest run of leading *full* blocks of its prompt
    that some earlier allocate (same salt) also had as leading full blocks, times the block
    size, capped at `len(prompt) - 1` tokens rounded down to whole blocks (the last prompt
    token is always computed: its logits start the decode; the core's rule). Blocks filled
    by decode tokens are not counted (random output never repeats in these traces).
    """
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    total = 0
    for line in lines:
        op = json.loads(line)
        if op["op"] != "allocate":
            continue
        tokens, salt = op["tokens"], op.get("salt")
        num_full = len(tokens) // block_size
        max_hit_blocks = (len(tokens) - 1) // block_size
        matched = 0
        for i in range(1, num_full + 1):
            key = (salt, tuple(tokens[: i * block_size]))
            if key in seen:
                if i <= max_hit_blocks:
                    matched = i
            else:
                seen.add(key)
        total += matched * block_size
    return total


def section_prefix(num_requests: int) -> None:
    config = TraceConfig(
        num_requests=num_requests, seed=4, num_system_prompts=4, system_prompt_len=512,
        shared_prompt_fraction=0.7, num_tenants=2, arrival_rate=2.0, max_running=128,
    )
    lines = _trace(config)
    bound = theoretical_prefix_hits(lines, 16)
    print(
        f"## prefix cache hits vs theoretical maximum ({num_requests} requests, "
        "4 system prompts x 512 tokens, 70% use one, 2 tenants)\n"
    )
    print("| pool (blocks x 16) | hit tokens | theoretical max | hits / max | query tokens | evictions | rejected |")
    print("|---|---|---|---|---|---|---|")
    for num_blocks in (_pool(16), 12_000, 6_000):
        r = replay(lines, num_blocks=num_blocks, block_size=16)
        print(
            f"| {num_blocks} | {r.prefix_hit_tokens} | {bound} | {r.prefix_hit_tokens / bound:.1%} | "
            f"{r.prefix_query_tokens} | {r.evictions} | {r.rejected} |"
        )
    print(
        "\ntheoretical max = infinite cache: per request, the longest leading run of full prompt "
        "blocks that an earlier request of the same tenant also had (capped so the last prompt "
        "token is computed). Smaller pools evict cached blocks and lose hits.\n"
    )


# ---- block-size sweep ------------------------------------------------------------------------
def section_sweep(num_requests: int) -> None:
    config = TraceConfig(
        num_requests=num_requests, seed=5, num_system_prompts=4, system_prompt_len=300,
        shared_prompt_fraction=0.6, parallel_fraction=0.2, parallel_n=4, num_tenants=2,
        arrival_rate=2.0, max_running=128,
    )
    lines = _trace(config)
    print(
        f"## block-size sweep ({num_requests} requests: 60% share one of 4 system prompts of 300 tokens, "
        f"20% sample n=4, 2 tenants; pool = {POOL_SLOTS} slots)\n"
    )
    print(
        "| block size | waste | peak used slots | prefix hit tokens | theoretical max | CoW copies "
        "| CoW copied slots | append step p50 us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for block_size in (8, 16, 32, 64, 128):
        r = replay(lines, num_blocks=_pool(block_size), block_size=block_size)
        _check_clean(r)
        print(
            f"| {block_size} | {r.waste_ratio:.2%} | {r.peak_used_blocks * block_size} | {r.prefix_hit_tokens} | "
            f"{theoretical_prefix_hits(lines, block_size)} | {r.cow_copies} | {r.cow_copies * block_size} | "
            f"{r.append_step_p50_us:.0f} |"
        )
    print()


def _check_clean(r: ReplayReport) -> None:
    if r.rejected or r.preempted or r.skipped:
        raise SystemExit(f"pool too small for this section: {r.rejected=} {r.preempted=} {r.skipped=}")


SECTIONS = {"waste": section_waste, "fork": section_fork, "prefix": section_prefix, "sweep": section_sweep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    args = parser.parse_args()
    for name in args.only.split(","):
        SECTIONS[name](args.requests)


if __name__ == "__main__":
    main()
