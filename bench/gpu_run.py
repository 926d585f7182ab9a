"""Phases, budgets and results that survive a stopped run (bench/gpu_check.py's runner).

A GPU session lends a few minutes of device time, and a command that runs past its limit is
killed with whatever it had not yet written. So the check is a list of phases, each with a time
budget, run in priority order against one global deadline:

- before a phase starts, it is skipped (and the skip logged) when less time is left to the
  deadline than the phase needs (`PhaseSpec.min_s`);
- inside a phase, work is a series of cells; the phase clock is checked before each cell, and
  once the phase's budget or the global deadline is spent the phase stops there (`OverBudget`),
  keeping the cells it finished;
- every record is one JSON line, flushed and fsynced at once (`ResultsLog`), and the summary
  files are rewritten after every phase (`Runner.on_phase_end`), so a run killed in phase k
  leaves phases 1 … k-1 complete and phase k's finished cells on disk, plus the line that
  says phase k started.

A cell that raises is recorded as a failed cell and the phase goes on: one broken variant never
hides the others. Nothing here needs a GPU; tests/kernels/test_gpu_run.py covers it.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

JSONL_NAME = "gpu_check.jsonl"


class OverBudget(Exception):
    """Raised by `PhaseClock.check` when the phase's budget or the global deadline is spent."""


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN/inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


class ResultsLog:
    """Append-only JSON lines in `out_dir/gpu_check.jsonl`, each flushed and fsynced as written."""

    def __init__(self, out_dir: Path, clock: Callable[[], float] = time.time) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / JSONL_NAME
        self._clock = clock
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(strict_json({"t": round(self._clock(), 3), **record}), default=str)
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a results log (a torn last line from a killed run is dropped)."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@dataclass(slots=True)
class PhaseClock:
    """Time left to a phase: its own budget or the global deadline, whichever ends first."""

    name: str
    ends_at: float
    now: Callable[[], float] = time.monotonic

    def remaining(self) -> float:
        return self.ends_at - self.now()

    def check(self, what: str = "") -> None:
        if self.remaining() <= 0:
            raise OverBudget(f"phase {self.name} out of time before {what or 'the next cell'}")


@dataclass(slots=True)
class PhaseContext:
    """What a phase's function gets: its clock, and `cell` to run and record one measurement."""

    phase: str
    clock: PhaseClock
    log: ResultsLog
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # rows whose check says ok: False
    errors: list[str] = field(default_factory=list)  # cells that raised

    def record(self, row: dict[str, Any]) -> None:
        """Keep and write one result row of this phase (`ok: False` marks a failed check)."""
        self.rows.append(row)
        if row.get("ok") is False:
            self.failures.append(str(row.get("check") or row.get("cell") or row))
        self.log.write({"phase": self.phase, "event": "row", **row})

    def cell(self, name: str, fn: Callable[[], dict[str, Any] | list[dict[str, Any]] | None]) -> bool:
        """Run one cell if time is left (else raise `OverBudget`); its row(s) are recorded
        with `cell: name`. An exception is recorded as a failed cell; returns whether it ran."""
        self.clock.check(name)
        started = time.monotonic()
        try:
            result = fn()
        except OverBudget:
            raise
        except Exception as exc:  # noqa: BLE001 - one cell's failure is a result, not a crash
            message = f"{type(exc).__name__}: {exc}"[:500]
            self.errors.append(f"{name}: {message}")
            self.record({"cell": name, "error": message,
                         "traceback": traceback.format_exc(limit=6)[-2000:]})
            return False
        rows = result if isinstance(result, list) else [result] if result else []
        for row in rows:
            self.record({"cell": name, "cell_s": round(time.monotonic() - started, 3), **row})
        return True


@dataclass(slots=True)
class PhaseSpec:
    """One phase: `budget_s` caps it; it is skipped when less than `min_s` is left overall.
    `gate`: a failed cell here (a correctness check) makes the run's exit status 1."""

    name: str
    budget_s: float
    fn: Callable[[PhaseContext], None]
    min_s: float = 0.0
    gate: bool = False
    about: str = ""


@dataclass(slots=True)
class PhaseResult:
    name: str
    status: str  # "done", "over budget", "error", "skipped"
    seconds: float
    rows: list[dict[str, Any]]
    failures: list[str]
    errors: list[str]
    gate: bool
    message: str = ""


class Runner:
    """Runs phases in order against one deadline (module doc); `on_phase_end(results)` is
    called after every phase, skipped ones included, with all results so far."""

    def __init__(self, log: ResultsLog, deadline_s: float,
                 now: Callable[[], float] = time.monotonic,
                 on_phase_end: Callable[[list[PhaseResult]], None] | None = None) -> None:
        self.log = log
        self.now = now
        self.deadline = now() + deadline_s
        self.results: list[PhaseResult] = []
        self.on_phase_end = on_phase_end

    def time_left(self) -> float:
        return self.deadline - self.now()

    def run(self, spec: PhaseSpec) -> PhaseResult:
        left = self.time_left()
        if left < max(spec.min_s, 1e-9):
            result = PhaseResult(spec.name, "skipped", 0.0, [], [], [], spec.gate,
                                 f"{left:.0f} s left before the deadline, the phase needs "
                                 f">= {spec.min_s:.0f} s")
            self.log.write({"phase": spec.name, "event": "skipped", "reason": result.message})
            return self._finish(result)
        started = self.now()
        clock = PhaseClock(spec.name, min(self.deadline, started + spec.budget_s), self.now)
        ctx = PhaseContext(spec.name, clock, self.log)
        self.log.write({"phase": spec.name, "event": "start", "budget_s": spec.budget_s,
                        "left_s": round(left, 1), "about": spec.about})
        status, message = "done", ""
        try:
            spec.fn(ctx)
        except OverBudget as exc:
            status, message = "over budget", str(exc)
        except Exception as exc:  # noqa: BLE001 - a phase's crash is logged; the next runs
            status, message = "error", f"{type(exc).__name__}: {exc}"[:500]
            ctx.errors.append(f"phase: {message}")
            self.log.write({"phase": spec.name, "event": "error", "message": message,
                            "traceback": traceback.format_exc(limit=8)[-3000:]})
        seconds = self.now() - started
        result = PhaseResult(spec.name, status, seconds, ctx.rows, ctx.failures, ctx.errors,
                             spec.gate, message)
        self.log.write({"phase": spec.name, "event": "end", "status": status,
                        "seconds": round(seconds, 2), "budget_s": spec.budget_s,
                        "num_rows": len(ctx.rows), "num_failures": len(ctx.failures),
                        "num_errors": len(ctx.errors),
                        "message": message})
        return self._finish(result)

    def _finish(self, result: PhaseResult) -> PhaseResult:
        self.results.append(result)
        if self.on_phase_end is not None:
            self.on_phase_end(self.results)
        return result

    def gate_failures(self) -> list[str]:
        """Failed checks and crashed cells of gating phases."""
        return [f"{r.name}: {f}" for r in self.results if r.gate for f in r.failures + r.errors]

    def errors(self) -> list[str]:
        """Cells (and phases) of any phase that raised: the smoke run's verdict."""
        return [f"{r.name}: {e}" for r in self.results for e in r.errors]


def write_summary(out_dir: Path, header: dict[str, Any], results: list[PhaseResult],
                  render: Callable[[PhaseResult], list[str]], preface: list[str] | None = None,
                  extra: dict[str, Any] | None = None) -> None:
    """gpu_check.json (every phase's status and rows, plus `extra`) and gpu_check.md (the
    phase table, `preface`, then `render` per phase), each written to a temporary name and
    renamed, so a kill mid-write leaves the previous one."""
    payload = {**header, **(extra or {}), "phases": [
        {"name": r.name, "status": r.status, "seconds": round(r.seconds, 2), "message": r.message,
         "failures": r.failures, "errors": r.errors, "rows": r.rows} for r in results]}
    _replace(out_dir / "gpu_check.json", json.dumps(strict_json(payload), indent=1, default=str))
    lines = [f"# GPU check — {header.get('device', '?')}", ""]
    lines += [f"{k}: {v}" for k, v in header.items() if k != "device"]
    lines += ["", "| phase | status | s | rows | failed checks | errors | note |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {len(r.rows)} | {len(r.failures)} | "
              f"{len(r.errors)} | {r.message[:120]} |" for r in results]
    lines.append("")
    lines += preface or []
    for r in results:
        lines += render(r)
    _replace(out_dir / "gpu_check.md", "\n".join(lines) + "\n")


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def rows_table(rows: list[dict[str, Any]], skip: tuple[str, ...] = ("traceback",)) -> list[str]:
    """Markdown tables of `rows`: one per set of columns (rows of one kind together, in
    first-seen order); floats to 3 significant digits."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(k for k in row if k not in skip), []).append(row)
    lines: list[str] = []
    for columns, members in groups.items():
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in members]
        lines.append("")
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")[:160]
