"""bench/gpu_run.py: the GPU check's phases, budgets, deadline and results that survive a kill.

No GPU: phases are plain functions and time is a fake clock, so every rule is exercised exactly.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    """A bench module by its top-level name (bench/ on sys.path, as gpu_check.py puts it)."""
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)


gr = _load("gpu_run")


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _runner(tmp_path: Path, deadline_s: float, clock: FakeClock, ends: list | None = None):
    log = gr.ResultsLog(tmp_path, clock=clock)
    return gr.Runner(log, deadline_s, now=clock,
                     on_phase_end=(lambda results: ends.append([r.name for r in results]))
                     if ends is not None else None), log


def _events(tmp_path: Path) -> list[tuple[str | None, str | None]]:
    return [(r.get("phase"), r.get("event")) for r in gr.read_records(tmp_path / gr.JSONL_NAME)]


def test_each_record_is_on_disk_as_soon_as_written(tmp_path: Path) -> None:
    log = gr.ResultsLog(tmp_path, clock=lambda: 1.0)
    log.write({"phase": "a", "value": float("nan"), "nested": [float("inf"), 2.5]})
    # read while the log is still open: nothing waits for close()
    (record,) = gr.read_records(tmp_path / gr.JSONL_NAME)
    assert record == {"t": 1.0, "phase": "a", "value": None, "nested": [None, 2.5]}
    log.close()


def test_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / gr.JSONL_NAME
    path.write_text('{"phase": "a"}\n{"phase": "b", "val')
    assert gr.read_records(path) == [{"phase": "a"}]


def test_cells_record_rows_and_a_failing_cell_does_not_stop_the_phase(tmp_path: Path) -> None:
    clock = FakeClock()
    runner, log = _runner(tmp_path, 100, clock)

    def phase(ctx) -> None:
        ctx.cell("one", lambda: {"x": 1})
        ctx.cell("boom", lambda: 1 / 0)
        ctx.cell("two", lambda: [{"x": 2}, {"x": 3, "ok": False, "check": "three"}])
        ctx.cell("nothing", lambda: None)

    result = runner.run(gr.PhaseSpec("p", 50, phase, gate=True))
    assert result.status == "done"
    assert [r.get("x") for r in result.rows] == [1, None, 2, 3]
    assert result.rows[1]["cell"] == "boom" and "ZeroDivisionError" in result.rows[1]["error"]
    assert result.errors == ["boom: ZeroDivisionError: division by zero"]
    assert result.failures == ["three"]
    assert runner.gate_failures() == ["p: three", "p: boom: ZeroDivisionError: division by zero"]
    assert _events(tmp_path) == [("p", "start"), ("p", "row"), ("p", "row"), ("p", "row"),
                                 ("p", "row"), ("p", "end")]


def test_failed_checks_gate_only_in_gating_phases(tmp_path: Path) -> None:
    runner, _ = _runner(tmp_path, 100, FakeClock())
    runner.run(gr.PhaseSpec("timing", 10, lambda ctx: ctx.record({"ok": False, "check": "slow"})))
    assert runner.gate_failures() == [] and runner.errors() == []
    runner.run(gr.PhaseSpec("checks", 10, lambda ctx: ctx.record({"ok": False, "check": "bad"}),
                            gate=True))
    assert runner.gate_failures() == ["checks: bad"]


def test_a_phase_stops_at_its_budget_and_keeps_its_finished_cells(tmp_path: Path) -> None:
    clock = FakeClock()
    runner, _ = _runner(tmp_path, 1000, clock)
    ran = []

    def phase(ctx) -> None:
        for i in range(10):
            def cell(i: int = i) -> dict:
                ran.append(i)
                clock.t += 4.0  # each cell takes 4 s of a 10 s budget
                return {"i": i}

            ctx.cell(f"c{i}", cell)

    result = runner.run(gr.PhaseSpec("p", 10, phase))
    assert result.status == "over budget" and ran == [0, 1, 2]
    assert [r["i"] for r in result.rows] == [0, 1, 2]
    assert "before c3" in result.message
    # the next phase still runs: the deadline is far
    assert runner.run(gr.PhaseSpec("q", 10, lambda ctx: ctx.record({"y": 1}))).status == "done"


def test_the_global_deadline_cuts_a_phase_before_its_budget(tmp_path: Path) -> None:
    clock = FakeClock()
    runner, _ = _runner(tmp_path, 6, clock)

    def phase(ctx) -> None:
        for i in range(5):
            ctx.cell(f"c{i}", lambda: (setattr(clock, "t", clock.t + 4.0), {"ok": True})[1])

    result = runner.run(gr.PhaseSpec("p", 100, phase))
    assert result.status == "over budget" and len(result.rows) == 2


def test_a_phase_that_would_not_fit_is_skipped_and_logged(tmp_path: Path) -> None:
    clock = FakeClock()
    ends: list = []
    runner, _ = _runner(tmp_path, 60, clock, ends)
    calls = []
    runner.run(gr.PhaseSpec("first", 50, lambda ctx: (calls.append("first"),
                                                      setattr(clock, "t", 45.0))))
    skipped = runner.run(gr.PhaseSpec("engine", 100, lambda ctx: calls.append("engine"), min_s=30))
    small = runner.run(gr.PhaseSpec("host", 10, lambda ctx: calls.append("host"), min_s=5))
    assert calls == ["first", "host"]
    assert skipped.status == "skipped" and "15 s left" in skipped.message
    assert small.status == "done"
    assert ends == [["first"], ["first", "engine"], ["first", "engine", "host"]]
    records = gr.read_records(tmp_path / gr.JSONL_NAME)
    assert {"phase": "engine", "event": "skipped"}.items() <= records[2].items()


def test_a_crashing_phase_is_an_error_and_the_next_phase_runs(tmp_path: Path) -> None:
    runner, _ = _runner(tmp_path, 100, FakeClock())

    def crash(ctx) -> None:
        ctx.record({"kept": True})
        raise RuntimeError("no kernel image")

    result = runner.run(gr.PhaseSpec("p", 10, crash, gate=True))
    assert result.status == "error" and result.rows == [{"kept": True}]
    assert runner.gate_failures() == ["p: phase: RuntimeError: no kernel image"]
    assert runner.run(gr.PhaseSpec("q", 10, lambda ctx: None)).status == "done"


def test_a_run_killed_mid_phase_keeps_the_earlier_phases(tmp_path: Path) -> None:
    """The summary files are rewritten after every phase; a kill (here SystemExit, what the
    SIGTERM handler raises) in phase 2 leaves phase 1's summary and phase 2's finished cells."""
    clock = FakeClock()

    def summary(results) -> None:
        gr.write_summary(tmp_path, {"device": "test"}, results, lambda r: gr.rows_table(r.rows))

    runner = gr.Runner(gr.ResultsLog(tmp_path, clock=clock), 100, now=clock, on_phase_end=summary)
    runner.run(gr.PhaseSpec("one", 10, lambda ctx: ctx.cell("a", lambda: {"v": 1.5})))

    def killed(ctx) -> None:
        ctx.cell("b", lambda: {"v": 2})
        raise SystemExit(124)

    with pytest.raises(SystemExit):
        runner.run(gr.PhaseSpec("two", 10, killed))
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [p["name"] for p in data["phases"]] == ["one"]
    assert data["phases"][0]["rows"][0]["v"] == 1.5
    assert "| 1.5 |" in (tmp_path / "gpu_check.md").read_text()
    events = _events(tmp_path)
    assert ("two", "start") in events and ("two", "row") in events and ("two", "end") not in events
    assert not list(tmp_path.glob("*.tmp"))


def test_rows_table_groups_rows_by_their_columns() -> None:
    lines = gr.rows_table([{"a": 1, "b": 2.123456}, {"c": "x|y"}, {"a": 3, "b": None},
                           {"c": float("inf"), "traceback": "..."}])
    assert lines == ["| a | b |", "|---|---|", "| 1 | 2.12 |", "| 3 | - |", "",
                     "| c |", "|---|", "| x/y |", "| inf |", ""]
    assert gr.rows_table([]) == []
