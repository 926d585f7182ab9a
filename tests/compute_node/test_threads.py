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
