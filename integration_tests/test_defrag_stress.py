"""Defragmentation forced as hard as it goes, with every sequence's output checked every step.

The bug this guards against (issue 9): a block counted as movable before the Forward that writes
it ran, so a plan made between a step's answer and its Forward copied unwritten memory. Here the
block manager runs its defrag policy after *every* step (the plan lands in whatever window the
policy check happens to hit, including between a Step answer and its Forward), and the test's
scheduler additionally asks for a plan after every Forward, alternating compaction and
contiguity. Hundreds of requests with shared system prompts (prefix hits) and parallel sampling
(forks, copy-on-write) run through the real processes; every output of every sequence is
compared with the float64 reference at every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from block_manager.client.admin import AdminClient
from demo.localstack import LocalStack
from demo.serving import ServingDriver
from integration_tests.conftest import CORE_SERVICES
from integration_tests.helpers import node_addresses, small_trace

AGGRESSIVE = {
    "PAGEDKV_DEFRAG__EVERY_N_STEPS": "1",
    "PAGEDKV_DEFRAG__CHECK_EVERY_STEPS": "1",
    "PAGEDKV_DEFRAG__MIN_CONTIGUITY": "1.0",
    "PAGEDKV_DEFRAG__MAX_MOVES": "64",
}


@pytest.fixture
def defrag_stack(tmp_path: Path, stack_env: dict[str, str]) -> Iterator[LocalStack]:
    stack = LocalStack(tmp_path / "stack", interp_env=stack_env, overrides={"block-manager": AGGRESSIVE})
    try:
        stack.up(CORE_SERVICES)
        yield stack
    finally:
        stack.down()


# By default 100 requests (~280 steps, every one defragmented: ~155 compaction and ~11
# contiguity plans, ~600 moves) reach every window above many times over; 80 made too few
# scattered tables for contiguity once prompts admitted together share their prefix blocks in
# that very step. `--slow`: 200.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("num_requests", [100, pytest.param(200, marks=pytest.mark.slow)])
def test_aggressive_defrag_never_changes_an_output(defrag_stack: LocalStack, num_requests: int) -> None:
    bm = defrag_stack.address("block-manager")
    driver = ServingDriver(bm, node_addresses(defrag_stack), num_heads=4, max_model_len=256, seed=9)
    admin = AdminClient(bm, timeout_s=20.0)
    kinds = ("compaction", "contiguity")

    def defrag_after_forward(step: int) -> None:
        admin.trigger_defrag("", kinds[step % 2])

    try:
        report = driver.run(small_trace(seed=9, num_requests=num_requests), on_step=defrag_after_forward)
    finally:
        driver.close()
    pools = report.final_status["pools"]
    try:
        assert admin.fsck().get("ok") is True
    finally:
        admin.close()
    assert report.check_policy == "every sequence, every step"
    assert report.check_failures == 0, f"{report.check_failures}/{report.checks} wrong, max rel {report.max_rel_error}"
    assert report.rejected == report.preempted == report.skipped == 0
    assert report.checks == report.forwarded_outputs > report.generated_tokens   # every output of every Forward
    # The workload reached what it is meant to stress.
    assert sum(int(p.get("prefix_hit_tokens", 0)) for p in pools) > 0
    assert report.forks > 0 and sum(int(p.get("cow_copies", 0)) for p in pools) > 0
    compaction = sum(int(p.get("compaction_plans", 0)) for p in pools)
    contiguity = sum(int(p.get("contiguity_plans", 0)) for p in pools)
    moves = sum(int(p.get("defrag_moves", 0)) for p in pools)
    print(f"steps {len(report.steps)} checks {report.checks} compaction plans {compaction} "
          f"contiguity plans {contiguity} moves {moves} aborted {sum(int(p.get('aborted_plans', 0)) for p in pools)}")
    assert compaction >= 10 and contiguity >= 10 and moves >= 100
