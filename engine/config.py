"""The engine's settings (`EngineConfig`): one object, shared by reference with the parts that
read it (`engine.scheduler`, `engine.swapping`, `engine.pipeline`), so a setting changed
between two steps (the benchmarks switch `async_scheduling`) is seen by all of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.async_policy import async_scheduling_from_env

MAX_NUM_SEQS = 4096          # a Step's appends (one per running sequence) stay within its item limit


def async_scheduling_default() -> bool:
    """Overlap is on unless `PAGEDKV_ASYNC_SCHEDULING` is 0/false/off/no (`LLM` decides by its
    nodes instead, `engine.async_policy`)."""
    return async_scheduling_from_env() is not False


PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 256               # running sequences at once
    max_num_batched_tokens: int = 2048    # new tokens per step (chunked prefill splits prompts)
    max_model_len: int | None = None      # None: the nodes' (the smallest)
    # How long a step waits out an unreachable block manager (a restart, a network blip),
    # resending it under its request id, before the engine gives up (EngineFailure).
    bm_unavailable_timeout_s: float = 120.0
    # How a running sequence gives up its blocks when another's append does not fit (docs/tiers.md):
    # "swap" moves its blocks to its node's host tier and back later (nothing recomputed; falls
    # back to recompute when the host tier is full or absent), "recompute" frees them and
    # recomputes prompt + outputs on re-admission, "auto": swap where the node has a host tier.
    preemption_mode: str = "auto"
    # Ask the nodes for each step's phase timings (GenerateStats; device syncs on a GPU).
    profile_nodes: bool = False
    # Plan and commit step N+1's Step while the nodes run step N (engine.pipeline); False:
    # one step after the other. Default: on, unless PAGEDKV_ASYNC_SCHEDULING=0.
    async_scheduling: bool = field(default_factory=async_scheduling_default)

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_seqs > MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be <= {MAX_NUM_SEQS} (the block manager's items per Step)")
        if self.bm_unavailable_timeout_s < 0:
            raise ValueError("bm_unavailable_timeout_s must be >= 0")


__all__ = ["MAX_NUM_SEQS", "PREEMPTION_MODES", "EngineConfig", "async_scheduling_default"]
