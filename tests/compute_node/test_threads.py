"""A node's thread budget (issue 21): `threads`, else the host's cores / nodes on the host."""

from __future__ import annotations

import numba
import torch

from compute_node.service.config import load_config
from compute_node.threads import apply_thread_budget, thread_budget


def test_the_budget_is_the_setting_or_the_hosts_share() -> None:
    assert thread_budget(3, nodes_per_host=2, num_cores=16) == 3
    assert thread_budget(None, nodes_per_host=2, num_cores=16) == 8
    assert thread_budget(None, nodes_per_host=1, num_cores=16) == 16
    assert thread_budget(None, nodes_per_host=4, num_cores=2) == 1     # never 0


def test_the_settings_come_from_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGEDKV_CN_NODES_PER_HOST", "2")
    monkeypatch.setenv("PAGEDKV_CN_THREADS", "1")
    cfg = load_config()
    assert (cfg.nodes_per_host, cfg.threads) == (2, 1)


def test_apply_caps_torch_and_numba() -> None:
    torch_before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    try:
        assert apply_thread_budget(1) == 1
        assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(torch_before)
        numba.set_num_threads(numba_before)


async def test_the_step_thread_runs_every_call_on_one_thread_off_the_loop() -> None:
    """Successive calls land on one long-lived thread (not the event loop's, not the default
    pool's), in order, even while the loop's default pool is busy with other work; and the
    thread's own settings (a Numba budget set there) hold for every later call."""
    import asyncio
    import threading

    from compute_node.service.step_thread import StepThread

    step = StepThread("step-test")
    numba_before = numba.get_num_threads()
    busy = threading.Event()
    try:
        loop_thread = threading.get_ident()
        blocker = asyncio.get_running_loop().run_in_executor(None, busy.wait, 30)   # holds a default worker
        await step.run(numba.set_num_threads, 1)
        order: list[int] = []
        seen = []
        for i in range(8):
            seen.append(await step.run(lambda i=i: (order.append(i), threading.get_ident(), numba.get_num_threads())))
            await asyncio.to_thread(lambda: None)   # default-pool traffic in between
        assert order == list(range(8))
        assert {ident for _, ident, _ in seen} == {step.ident} and step.ident != loop_thread
        assert all(n == 1 for _, _, n in seen)
        assert numba.get_num_threads() == numba_before   # per-thread: the loop's thread is untouched
        # calls submitted at once still run one at a time, in submission order
        results = await asyncio.gather(*(step.run(order.append, 100 + i) for i in range(5)))
        assert results == [None] * 5 and order[-5:] == [100, 101, 102, 103, 104]
    finally:
        busy.set()
        await blocker
        step.close()


def test_the_node_spins_briefly_unless_the_environment_says_otherwise() -> None:
    from compute_node.service.cli import NODE_SPINCOUNT, short_omp_spin

    env: dict[str, str] = {}
    assert short_omp_spin(env) is True and env == {"GOMP_SPINCOUNT": NODE_SPINCOUNT}
    for own in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(own)
        assert short_omp_spin(env) is False and env == own


def test_a_node_process_sets_its_spin_before_torch_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`compute-node serve` sets it in main(), and nothing imported before main() loads torch."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    missing = tmp_path / "missing.yaml"
    code = ("import os, sys\nfrom compute_node.service import cli\nbefore = 'torch' in sys.modules\n"
            f"rc = cli.main(['serve', '--config', {str(missing)!r}])\n"
            "print(before, rc, os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-3:] == ["False", "2", "10000"], (out.stdout, out.stderr)
