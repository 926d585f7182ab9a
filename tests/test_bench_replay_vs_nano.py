"""The replay comparison's own logic, without nano-vllm: the summary's medians and speed ratio,
its refusal of runs that replayed different work, and the nano-vllm driver's refusals (not a
checkout; a trace with forks, which nano-vllm's block manager cannot do)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_replay_vs_nano as brn  # noqa: E402
import nano_replay  # noqa: E402


def _ours(wall: float, replay_s: float, hits: int = 96) -> tuple[float, dict]:
    return wall, {"wall_s": replay_s, "core_s": replay_s / 2, "prefix_hit_tokens": hits}


def _nano(wall: float, replay_s: float, hits: int = 96) -> tuple[float, dict]:
    return wall, {"replay_s": replay_s, "prefix_hit_tokens": hits}


def test_summary_takes_medians_and_the_whole_process_speed() -> None:
    s = brn.summarize([_ours(4.0, 3.0), _ours(6.0, 5.0), _ours(5.0, 4.0)],
                      [_nano(10.0, 9.0), _nano(9.0, 8.0), _nano(11.0, 10.0)])
    assert (s["ours_process_s"], s["nano_process_s"]) == (5.0, 10.0)
    assert (s["ours_replay_s"], s["ours_core_s"], s["nano_replay_s"]) == (4.0, 2.0, 9.0)
    assert s["speed"] == 2.0 and s["prefix_hit_tokens"] == 96


def test_summary_refuses_sides_that_replayed_different_work() -> None:
    with pytest.raises(ValueError, match=r"disagree on prefix-cache hit tokens: \[80, 96\]"):
        brn.summarize([_ours(4.0, 3.0)], [_nano(9.0, 8.0, hits=80)])


def test_the_nano_driver_needs_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a nano-vllm checkout"):
        nano_replay.load_nano(tmp_path)


def test_the_nano_driver_refuses_forks() -> None:
    lines = [json.dumps({"op": "fork", "parent": "r0", "children": ["r0/1"]})]
    with pytest.raises(SystemExit, match="no 'fork'"):
        nano_replay.replay(lines, object(), object)
