"""A core with one pool "p" of block size 4, and one step of it run end to end: what the
rule-by-rule core tests (tiers, late ids) build on."""

from __future__ import annotations

from block_manager.core import BlockManager

BS = 4


def one_pool(num_blocks: int, host: int = 0) -> BlockManager:
    m = BlockManager(watermark=0.0)
    m.add_pool("p", num_blocks, BS, host_num_blocks=host)
    return m


def run_step(m: BlockManager) -> int:
    """Close the pool's open step and report its Forward done; its id."""
    out = m.close_step("p")
    if out is None:
        raise AssertionError("the open step has no work to hand out")
    m.settle_steps("p", out.step_id)
    return out.step_id
