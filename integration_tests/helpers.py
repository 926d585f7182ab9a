"""Shared helpers of the integration tests (also imported by their client subprocesses)."""

from __future__ import annotations

from block_manager.trace.format import TraceOp, parse_trace
from block_manager.trace.generate import TraceConfig, generate_trace
from demo.localstack import LocalStack

# Short leases so a killed node is fenced quickly; set through the compose file's own
# `${PAGEDKV_LEASE_TTL_S:-10}` interpolation, as an operator would.
LEASE_TTL_S = 4.0
NODES = {"node-0": "compute-node-0", "node-1": "compute-node-1"}
def small_trace(seed: int, num_requests: int = 16, prefix: str = "") -> list[TraceOp]:
    cfg = TraceConfig(
        num_requests=num_requests, seed=seed, num_system_prompts=2, system_prompt_len=48,
        shared_prompt_fraction=0.6, prompt_len_min=8, prompt_len_max=96, output_len_min=6,
        output_len_max=40, parallel_n=3, parallel_fraction=0.3, arrival_rate=1.0, max_running=12,
        num_tenants=2,
    )
    lines = list(generate_trace(cfg))
    if prefix:
        # distinct sequence ids per client process: rename through the trace text itself
        lines = [line.replace('"r', f'"{prefix}r') for line in lines]
    return parse_trace(lines)


def node_addresses(stack: LocalStack) -> dict[str, str]:
    return {node: stack.address(service) for node, service in NODES.items()}
