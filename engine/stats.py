"""The engine's counters and recent latencies (the API server exports them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.stats import percentile

STAT_WINDOW = 100_000


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (the API server exports them)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_failed_steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    num_finished: int = 0
    # recent samples only (a long-running server must not grow without bound)
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=STAT_WINDOW))   # arrival → first token
    itl_s: deque[float] = field(default_factory=lambda: deque(maxlen=STAT_WINDOW))    # between tokens
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=STAT_WINDOW))
    bm_s: float = 0.0          # time in block manager calls (the Step)
    num_bm_rpcs: int = 0       # block manager round trips made by steps
    node_s: float = 0.0        # time in Generate calls (wall, nodes in parallel)
    # the engine thread's own work around the node calls: building the Generates, accepting
    # the tokens, the outputs (without async scheduling it adds to the nodes' time; with it,
    # it runs while the nodes compute the next step)
    prepare_s: float = 0.0
    complete_s: float = 0.0
    outputs_s: float = 0.0
    # host tier (docs/tiers.md): sequences swapped out / in, swap-outs that fell back to
    # recompute, tokens recomputed by recompute preemption, and the tier moves the nodes ran
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    recompute_fallbacks: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    host_hit_tokens: int = 0
    # disk tier (docs/tiers.md): host blocks spilled to disk, blocks / prompt tokens onboarded
    # from disk (disk->host->device; not in host_hit_tokens)
    disk_offloaded_blocks: int = 0
    disk_onboarded_blocks: int = 0
    disk_hit_tokens: int = 0
    # prefix fetch (docs/prefix_fetch.md): prompt tokens admitted as blocks pulled from another node
    fetched_tokens: int = 0
    # async scheduling (engine.pipeline): decode tokens planned before their id was known,
    # those dropped because their sequence stopped, those of them the block manager took
    # before their id (they start or fill a block: late ids), and sequences that sat a step
    # out (not mirrored by the client: their Step's outcome was unknown)
    speculative_tokens: int = 0
    speculative_dropped: int = 0
    late_tokens: int = 0
    speculation_waits: int = 0

    def summary(self) -> dict[str, float]:
        """Counters and latency percentiles (ms) as a flat mapping."""
        def p(xs: deque[float], q: float) -> float:
            return 1e3 * percentile(xs, q) if xs else 0.0

        return {
            "steps": self.num_steps, "preemptions": self.num_preemptions,
            "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_hit_tokens": (self.cached_prompt_tokens - self.host_hit_tokens - self.disk_hit_tokens
                                  - self.fetched_tokens),
            "fetched_tokens": self.fetched_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "disk_offloaded_blocks": self.disk_offloaded_blocks, "disk_onboarded_blocks": self.disk_onboarded_blocks,
            "disk_hit_tokens": self.disk_hit_tokens,
            "swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks,
            "offloaded_blocks": self.offloaded_blocks, "onboarded_blocks": self.onboarded_blocks,
            "recomputed_tokens": self.recomputed_tokens, "recompute_fallbacks": self.recompute_fallbacks,
            "swap_outs": self.num_swap_outs, "swap_ins": self.num_swap_ins,
            "speculative_tokens": self.speculative_tokens, "speculative_dropped": self.speculative_dropped,
            "late_tokens": self.late_tokens,
            "speculation_waits": self.speculation_waits,
            "ttft_p50_ms": p(self.ttft_s, 50), "ttft_p99_ms": p(self.ttft_s, 99),
            "itl_p50_ms": p(self.itl_s, 50), "itl_p99_ms": p(self.itl_s, 99),
        }


__all__ = ["STAT_WINDOW", "EngineStats"]
