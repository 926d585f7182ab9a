"""The attention demo with swaps forced every few steps (issue 18): attention-only compute nodes
as real processes, each with a host tier; every few steps the scheduler swaps running sequences
out to host and the previous ones back in, through the client's step helper, and every
sequence's attention output is still compared with the float64 reference at every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from block_manager.client.admin import AdminClient
from block_manager.trace.format import parse_trace
from block_manager.trace.generate import TraceConfig, generate_trace
from demo.attention import NODES
from demo.localstack import LocalStack
from demo.serving import ServingDriver


@pytest.mark.timeout(600)
def test_attention_outputs_equal_float64_with_swaps_every_few_steps(tmp_path: Path) -> None:
    cfg = TraceConfig(
        num_requests=24, seed=5, num_system_prompts=2, system_prompt_len=40, shared_prompt_fraction=0.5,
        prompt_len_min=8, prompt_len_max=64, output_len_min=12, output_len_max=40, parallel_n=2,
        parallel_fraction=0.2, arrival_rate=1.0, max_running=10, num_tenants=1,
    )
    ops = parse_trace(list(generate_trace(cfg)))
    env = {"PAGEDKV_CN_NUM_BLOCKS": "256", "PAGEDKV_CN_HOST_KV_MEMORY": str(64 << 20), "PAGEDKV_LOG_LEVEL": "WARNING"}
    with LocalStack(tmp_path / "stack", interp_env=env) as stack:
        stack.up(["block-manager", *NODES])
        bm = stack.address("block-manager")
        driver = ServingDriver(bm, {f"node-{i}": stack.address(n) for i, n in enumerate(NODES)}, num_heads=4,
                               max_model_len=128, seed=5, swap_every=3, swap_count=2)
        try:
            report = driver.run(ops)
        finally:
            driver.close()
        with AdminClient(bm) as admin:
            fsck = admin.fsck()
    pools = report.final_status["pools"]
    assert fsck.get("ok") is True, fsck
    assert report.check_policy == "every sequence, every step"
    assert report.check_failures == 0, f"{report.check_failures}/{report.checks} wrong, max rel {report.max_rel_error}"
    assert report.checks == report.forwarded_outputs > report.generated_tokens > 0
    assert report.swapped_out >= 6 and report.swapped_in >= 4 and report.swap_refused == 0, report.swap_errors[:3]
    out_blocks = sum(int(p.get("swapped_out_blocks", 0)) for p in pools)
    in_blocks = sum(int(p.get("swapped_in_blocks", 0)) for p in pools)
    assert out_blocks >= report.swapped_out and in_blocks >= report.swapped_in, pools
    assert all(int(p.get("host_num_blocks", 0)) > 0 for p in pools), pools


def test_attention_node_host_tier_config() -> None:
    """An attention-only node sizes its host tier before registering: bytes need a block size."""
    from pydantic import ValidationError

    from compute_node.service.config import ComputeNodeConfig

    with pytest.raises(ValidationError, match="host_kv_memory on an attention-only node needs an explicit block_size"):
        ComputeNodeConfig(host_kv_memory=1 << 20)
    assert ComputeNodeConfig(host_kv_memory=1 << 20, block_size=16).host_kv_memory == 1 << 20
    assert ComputeNodeConfig(host_kv_blocks=8).host_kv_blocks == 8
