"""Every kind of check runs by default (issue 24): long sweeps may move behind `--slow` to keep
`./scripts/run.sh test` within minutes, but never the last test of a kind. The kinds
(`tests/fixtures/suite_kinds.py`) are recognised from test ids, paths and fixtures, so a new test
of a kind counts automatically; the counts are printed with `-s` (and in the assertion when one is
missing).

Two checks: at collection (below: no kind left with skip markers only) and by outcome at the end
of the run (`KindOutcomes`, registered by the root conftest.py: a kind whose every test skipped
at run time, e.g. PostgreSQL without `initdb`, is reported missing, and fails the run in CI).
Both judge the whole default suite only: under `-k`, `-m`, or a narrower path they stand aside.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.suite_kinds import KINDS, whole_default_suite

ROOT = Path(__file__).resolve().parents[1]


def _skipped(item: pytest.Item) -> bool:
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
               for m in item.iter_markers())


def test_every_kind_of_check_runs_by_default(request: pytest.FixtureRequest) -> None:
    if not whole_default_suite(request.config):
        pytest.skip("judges the whole default suite only (run without -k / -m / --slow / narrower paths)")
    items = [i for i in request.session.items if not _skipped(i)]
    counts = {kind: sum(1 for i in items if matches(i)) for kind, matches in KINDS.items()}
    print("\n".join(f"{n:5d}  {kind}" for kind, n in counts.items()) + f"\n{len(items):5d}  tests in the default run")
    missing = [kind for kind, n in counts.items() if n == 0]
    assert not missing, f"no test of these kinds runs by default (moved behind --slow?): {missing}; counts {counts}"


def test_the_heavy_first_schedule_names_existing_modules(request: pytest.FixtureRequest) -> None:
    """The root conftest hands these modules to the xdist workers first; a renamed or deleted
    module would silently drop out of that schedule."""
    [root_conftest] = [p for p in request.config.pluginmanager.get_plugins()
                       if getattr(p, "__file__", None) == str(ROOT / "conftest.py")]
    heavy_first = root_conftest.HEAVY_FIRST
    missing = [path for path in heavy_first if not (ROOT / path).is_file()]
    assert not missing, f"HEAVY_FIRST (conftest.py) names modules that do not exist: {missing}"
    assert len(set(heavy_first)) == len(heavy_first), "HEAVY_FIRST lists a module twice"


# ---- the outcome check and CI's PostgreSQL rule, on a tiny suite in a subprocess ------------
# (no "postgres" in these tests' names: the PostgreSQL kind matches ids, and these need no server)

_TINY_CONFTEST = """
import os

import pytest

import tests.fixtures.postgres as pg
from tests.fixtures.postgres import postgres_cluster  # noqa: F401 (the fixture under test)
from tests.fixtures.suite_kinds import KindOutcomes

pg._SEARCH_DIRS = ()   # found only on PATH, which the test strips of initdb


def pytest_configure(config):
    kinds = {"PostgreSQL": lambda i: "postgres_cluster" in i.fixturenames,
             "runtime skip": lambda i: "runtime_skip" in i.nodeid,
             "plain": lambda i: "plain" in i.nodeid}
    only = os.environ.get("TINY_KINDS")
    if only:
        kinds = {k: v for k, v in kinds.items() if k in only.split(",")}
    config.pluginmanager.register(KindOutcomes(kinds, judge=lambda config: True), "tiny-kinds")
"""

_TINY_TESTS = """
import pytest


def test_needs_pg(postgres_cluster):
    assert postgres_cluster.port


def test_runtime_skip():
    pytest.skip("no accelerator here")


def test_plain():
    assert 1 + 1 == 2
"""


def _run_tiny(tmp_path: Path, *args: str, ci: bool, kinds: str = "") -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(_TINY_CONFTEST)
    (tmp_path / "test_tiny.py").write_text(_TINY_TESTS)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not (Path(d) / "initdb").exists())
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env.update(PATH=path, PYTHONPATH=str(ROOT), TINY_KINDS=kinds, **({"CI": "true"} if ci else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_pg_fixture_without_a_server_skips_locally_and_the_missing_kinds_are_reported(tmp_path: Path) -> None:
    proc = _run_tiny(tmp_path, ci=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 2 skipped" in out, out
    assert "PostgreSQL server binaries (initdb, pg_ctl) not found" in out, out
    assert "kinds of checks that did not run: 2 (reported only" in out, out
    assert "PostgreSQL: none of its tests ran (test_tiny.py::test_needs_pg: skipped: PostgreSQL" in out, out
    assert "runtime skip: none of its tests ran (test_tiny.py::test_runtime_skip: skipped: no accelerator here)" \
        in out, out


def test_pg_fixture_without_a_server_fails_in_ci(tmp_path: Path) -> None:
    proc = _run_tiny(tmp_path, ci=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "1 passed, 1 skipped, 1 error" in out, out
    assert "CI=true requires them" in out, out
    assert "kinds of checks that did not run: 2 (the run FAILS (CI))" in out, out
    assert "PostgreSQL: none of its tests ran (test_tiny.py::test_needs_pg: error at setup)" in out, out


def test_a_kind_skipped_at_run_time_fails_ci_with_every_test_green(tmp_path: Path) -> None:
    """No failure, no error: only the outcome count fails the run (and passes once every kind ran)."""
    proc = _run_tiny(tmp_path, "-k", "not _pg", ci=True, kinds="runtime skip,plain")
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "1 passed, 1 skipped, 1 deselected" in out, out
    assert "runtime skip: none of its tests ran" in out and "plain:" not in out, out
    ok = _run_tiny(tmp_path, "-k", "plain", ci=True, kinds="plain")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "did not run" not in ok.stdout, ok.stdout


def test_the_outcome_check_judges_on_the_xdist_controller(tmp_path: Path) -> None:
    """CI runs with xdist workers: the kinds travel with the reports to the controller, which judges."""
    proc = _run_tiny(tmp_path, "-n", "2", "-k", "not _pg", ci=True, kinds="runtime skip,plain")
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "1 passed, 1 skipped" in out and "runtime skip: none of its tests ran" in out, out


def test_the_pg_kind_means_tests_that_need_the_server() -> None:
    """A mention of postgres in an id (a manifest's name, a URL that must be refused) needs no
    server and would count the kind as run on a machine without one."""
    from types import SimpleNamespace

    matches = KINDS["PostgreSQL (a real server)"]

    def item(nodeid: str, *fixtures: str) -> pytest.Item:
        return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures))  # type: ignore[return-value]

    assert matches(item("tests/a.py::test_store[postgres]", "store"))
    assert matches(item("tests/a.py::test_rows[postgres-UPDATE x SET y = '[1]'-journal]", "opened"))
    assert matches(item("tests/a.py::test_kill", "fresh_postgres_url"))
    assert not matches(item("tests/a.py::test_store[sqlite]", "store"))
    assert not matches(item("tests/deploy/test_kubernetes_manifests.py::test_valid[StatefulSet/postgres]", "doc"))
    assert not matches(item("tests/a.py::test_bad_urls[postgresql+psycopg://u@127.0.0.1:1/db]", "url"))
