"""The block manager and two compute nodes as real processes (from docker-compose.yml), driven
through the client library over real sockets, with faults: SIGKILL of either service.

Tests that only drive the stack share one (`stack`) and free everything they allocate; tests
that kill a service get a stack of their own (`fresh_stack`), so no test depends on the order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from block_manager.client import BlockManagerClient
from block_manager.client.admin import AdminClient
from block_manager.client.errors import FailedPreconditionError, NotFoundError
from compute_node.client import ComputeNodeClient
from demo.localstack import LocalStack
from demo.serving import ServingDriver
from integration_tests.helpers import LEASE_TTL_S, node_addresses, small_trace
from tests.support import fork_server
from tests.support.polling import eventually_sync

NUM_HEADS = 4


def _driver(stack: LocalStack, seed: int = 0, scheduler_id: str | None = None) -> ServingDriver:
    """A scheduler that checks every sequence's output at every step."""
    return ServingDriver(stack.address("block-manager"), node_addresses(stack), num_heads=NUM_HEADS,
                         max_model_len=256, sample_every=2, seed=seed, scheduler_id=scheduler_id)


def _admin(stack: LocalStack) -> AdminClient:
    return AdminClient(stack.address("block-manager"), timeout_s=20.0)


def _tables(admin: AdminClient) -> dict[str, tuple[tuple[int, ...], int]]:
    seqs = admin.list_sequences().get("sequences", [])
    return {s["seq_id"]: (tuple(s.get("block_table", [])), int(s.get("num_tokens", 0))) for s in seqs}


def test_mixed_workload_outputs_match_reference(stack: LocalStack) -> None:
    driver = _driver(stack)
    try:
        ops = small_trace(seed=1)
        report = driver.run(ops, defrag_at_step=20)
    finally:
        driver.close()
    assert report.checks > 0 and report.check_failures == 0, report.max_rel_error
    assert report.rejected == report.preempted == report.skipped == 0
    pools = report.final_status["pools"]
    assert sum(int(p.get("prefix_hit_tokens", 0)) for p in pools) > 0        # shared system prompts hit
    assert report.forks > 0 and sum(int(p.get("cow_copies", 0)) for p in pools) > 0   # fork + CoW
    assert report.defrag["trigger"] is not None and "high_water_after" in report.defrag
    assert report.deferred_tokens > 0                                       # in-block appends skipped the RPC
    assert report.data_plane_rpcs < report.generated_tokens
    with _admin(stack) as admin:
        assert admin.fsck().get("ok") is True
        assert _tables(admin) == {}                                          # everything freed


def _cli(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "block-manager")
    return subprocess.run([exe, "admin", "--target", stack.address("block-manager"), *args],
                          capture_output=True, text=True, timeout=60)


def test_admin_cli_against_the_live_stack(stack: LocalStack) -> None:
    status = _cli(stack, "--json", "status")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "serving"
    nodes = _cli(stack, "--json", "nodes")
    assert nodes.returncode == 0
    assert {n["node_id"] for n in json.loads(nodes.stdout)["nodes"]} == {"node-0", "node-1"}
    assert _cli(stack, "--json", "seqs").returncode == 0
    fsck = _cli(stack, "fsck")
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    table = _cli(stack, "nodes")                                             # human-readable table
    assert table.returncode == 0 and "node-0" in table.stdout


def test_block_manager_sigkill_mid_workload(fresh_stack: LocalStack) -> None:
    """Kill -9 the block manager mid-run, restart it on the same SQLite file: every
    acknowledged operation is there, the nodes keep their epochs, the run completes."""
    with ComputeNodeClient(fresh_stack.address("compute-node-0")) as n0:
        epoch_before = n0.node_info().epoch
    driver = _driver(fresh_stack, seed=2)
    seen: dict[str, object] = {}

    def crash_at(step: int) -> None:
        if step != 12:
            return
        with _admin(fresh_stack) as admin:
            seen["before"] = _tables(admin)
        fresh_stack.kill("block-manager")
        fresh_stack.start("block-manager")
        with _admin(fresh_stack) as admin:
            seen["after"] = _tables(admin)
            seen["fsck"] = admin.fsck()

    try:
        report = driver.run(small_trace(seed=2), on_step=crash_at)
    finally:
        driver.close()
    assert seen["before"], "the crash must happen while sequences are live"
    # Acknowledged state survived. The client may have deferred in-block appends that the
    # block manager had not been told yet (by design), so compare tables and lengths as the
    # block manager had acknowledged them.
    assert seen["after"] == seen["before"]
    assert seen["fsck"]["ok"] is True
    assert report.checks > 0 and report.check_failures == 0
    assert report.rejected == report.preempted == 0
    with ComputeNodeClient(fresh_stack.address("compute-node-0")) as n0:
        assert n0.node_info().epoch == epoch_before                         # nodes carried on


def test_compute_node_sigkill_fences_and_restart_registers_new_epoch(fresh_stack: LocalStack) -> None:
    client = BlockManagerClient(fresh_stack.address("block-manager"), timeout_s=10.0)
    try:
        with ComputeNodeClient(fresh_stack.address("compute-node-1")) as n1:
            old_epoch = n1.node_info().epoch
        step = client.step()
        step.allocate("victim", "node-1", list(range(40)))
        step.allocate("survivor", "node-0", list(range(40)))
        admitted = step.commit()
        assert not admitted.failures
        fresh_stack.kill("compute-node-1")
        with _admin(fresh_stack) as admin:
            eventually_sync(
                lambda: {n["node_id"]: n for n in admin.list_nodes()["nodes"]}["node-1"].get("fenced"),
                timeout_s=LEASE_TTL_S * 4 + 10, interval_s=0.25, what="lease of the killed node expiring",
            )
            tables = _tables(admin)
            assert "victim" not in tables and "survivor" in tables          # blocks reclaimed, node-0 untouched
            assert admin.fsck()["ok"] is True
        step = client.step()
        step.append("victim", [7])
        outcome = step.commit().appends["victim"]
        assert isinstance(getattr(outcome, "error", None), (NotFoundError, FailedPreconditionError))
        # restart: a new epoch, and it serves new sequences
        fresh_stack.start("compute-node-1")
        with ComputeNodeClient(fresh_stack.address("compute-node-1")) as n1:
            info = n1.node_info()
            assert info.registered and info.epoch > old_epoch
        # No Forward ever ran for the admissions: report so (the block manager drops what the
        # step wrote, and the node's next step builds on the last one it really applied).
        client.report(admitted.steps["node-0"], ok=False)
        settled = client.flush_reports()
        assert settled is not None and settled.dropped == {"survivor"}
    finally:
        client.close()
    driver = _driver(fresh_stack, seed=3, scheduler_id=client.scheduler_id)  # the pools' lease holder
    try:
        report = driver.run(small_trace(seed=3, num_requests=8))
    finally:
        driver.close()
    assert report.check_failures == 0 and report.checks > 0
    assert {int(p["num_used_blocks"]) for p in report.final_status["pools"]} == {0}


_LOAD_CHILD = """
import json, sys
from integration_tests.helpers import small_trace
from demo.serving import ServingDriver
bm, node_id, address, prefix, seed = sys.argv[1:6]
d = ServingDriver(bm, {node_id: address}, num_heads=4, max_model_len=256, seed=int(seed))
try:
    r = d.run(small_trace(seed=int(seed), num_requests=8, prefix=prefix))
finally:
    d.close()
print(json.dumps({"checks": r.checks, "failures": r.check_failures, "rejected": r.rejected, "preempted": r.preempted}))
"""


def test_concurrent_schedulers_each_driving_its_own_node(stack: LocalStack) -> None:
    """Two scheduler processes share the block manager, each with its own node (one scheduler
    drives a pool at a time); a third one trying to drive a held pool is refused."""
    root = Path(__file__).resolve().parents[1]
    nodes = node_addresses(stack)
    argvs = [[sys.executable, "-c", _LOAD_CHILD, stack.address("block-manager"), node_id, address, f"c{i}-",
              str(10 + i)] for i, (node_id, address) in enumerate(sorted(nodes.items()))]
    with ThreadPoolExecutor(len(argvs)) as pool:   # side by side: each its own process
        runs = list(pool.map(lambda argv: fork_server.run(argv, cwd=root, text=True, timeout=300), argvs))
    results = []
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert all(r["failures"] == 0 and r["checks"] > 0 for r in results), results
    with _admin(stack) as admin:
        assert admin.fsck()["ok"] is True
        assert _tables(admin) == {}


def test_readme_client_example_runs_against_the_stack(stack: LocalStack) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "PAGEDKV_TARGET": stack.address("block-manager")}
    run = subprocess.run([sys.executable, str(root / "examples" / "embed_client.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(no RPC)" in run.stdout and "deferred tokens" in run.stdout
