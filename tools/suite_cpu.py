"""Where the test suite's CPU seconds go (issue 24): an opt-in pytest plugin and its report.

    PAGEDKV_TEST_CPU_DIR=/tmp/cpu ./scripts/run.sh test -p tools.suite_cpu --durations=60
    python -m tools.suite_cpu /tmp/cpu [--files 40] [--tests 40]

Each pytest process (the xdist workers, or the one serial process) appends one JSON line per
test to `<dir>/<pid>.jsonl`: the CPU time of the process itself and of every child process it
reaped (`RUSAGE_CHILDREN`: the services, CLIs and simulator subprocesses a test starts and waits
for) across the test's setup, call and teardown, and the same for its collection. A module- or
session-scoped fixture counts in the first test that uses it. Processes a test never reaps
(a daemon left running) are not counted, nor are the service processes started through the
fork server (tests/support/fork_server.py: the server reaps them, and its CPU reaches the test
process when it ends, after the last test); run with PAGEDKV_TEST_FORK_SERVER=0 to count them
per test. The suite-cost line of the root conftest covers the whole run. The figures are CPU
time, so they move with the machine's load: compare changes side by side (BENCHMARKS.md,
"Test-suite cost").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

ENV_DIR = "PAGEDKV_TEST_CPU_DIR"
_out: IO[str] | None = None


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# Children are counted from when this plugin loads: `scripts/run.sh test` execs pytest from the
# shell that built the venv, and pip's CPU is not the suite's.
_CHILDREN_AT_LOAD = _cpu_s(resource.RUSAGE_CHILDREN)


def _cpu() -> tuple[float, float]:
    """(own, reaped children's) CPU-s."""
    return _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN) - _CHILDREN_AT_LOAD


def _write(record: dict[str, Any]) -> None:
    global _out
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    if _out is None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        _out = open(Path(directory) / f"{os.getpid()}.jsonl", "a")   # noqa: SIM115 (open for the session)
    _out.write(json.dumps(record) + "\n")
    _out.flush()


def pytest_collection_finish(session: pytest.Session) -> None:
    own, children = _cpu()
    _write({"kind": "collect", "self": own, "children": children, "items": len(session.items)})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own0, children0 = _cpu()
    started = time.monotonic()
    yield
    own1, children1 = _cpu()
    _write({"kind": "test", "id": item.nodeid, "self": own1 - own0, "children": children1 - children0,
            "wall": time.monotonic() - started})


def pytest_sessionfinish(session: pytest.Session) -> None:
    own, children = _cpu()
    _write({"kind": "end", "self": own, "children": children})


def _records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.open()]


def report(directory: Path, num_files: int = 40, num_tests: int = 40) -> str:
    """Tests' CPU per file and the costliest tests, largest first."""
    records = _records(directory)
    tests = [r for r in records if r["kind"] == "test"]
    collect = [r["self"] + r["children"] for r in records if r["kind"] == "collect"]
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in tests:
        row = per_file[r["id"].split("::")[0]]
        row[0] += r["self"]
        row[1] += r["children"]
        row[2] += r["wall"]
        row[3] += 1
    lines = [f"{len(tests)} tests, {sum(r['self'] + r['children'] for r in tests):.1f} CPU-s "
             f"(in the pytest processes {sum(r['self'] for r in tests):.1f}, in processes they reaped "
             f"{sum(r['children'] for r in tests):.1f}); collection per process: "
             + ", ".join(f"{c:.1f}" for c in collect),
             "", f"{'CPU-s':>7} {'own':>6} {'reaped':>6} {'wall s':>7} {'tests':>5}  file"]
    for name, (own, children, wall, n) in sorted(per_file.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:num_files]:
        lines.append(f"{own + children:7.1f} {own:6.1f} {children:6.1f} {wall:7.1f} {int(n):5d}  {name}")
    lines += ["", f"{'CPU-s':>7} {'own':>6} {'reaped':>6} {'wall s':>7}  test"]
    for r in sorted(tests, key=lambda r: -(r["self"] + r["children"]))[:num_tests]:
        own, children = r["self"], r["children"]
        lines.append(f"{own + children:7.1f} {own:6.1f} {children:6.1f} {r['wall']:7.1f}  {r['id']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.suite_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help=f"the {ENV_DIR} of the run")
    parser.add_argument("--files", type=int, default=40, help="files to list")
    parser.add_argument("--tests", type=int, default=40, help="tests to list")
    args = parser.parse_args(argv)
    if not any(args.directory.glob("*.jsonl")):
        print(f"error: no *.jsonl records in {args.directory} (run the tests with -p tools.suite_cpu and "
              f"{ENV_DIR} set)", file=sys.stderr)
        return 2
    try:
        print(report(args.directory, args.files, args.tests))
    except BrokenPipeError:           # `| head`
        sys.stdout = None  # type: ignore[assignment]   # nothing more to flush at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
