"""The fork server the suite starts its service processes with (tests/support/fork_server.py)
must start what `exec` would: the same argv, environment, working directory, session, output,
exit status and signals; and hand anything it cannot do exactly to subprocess.Popen."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from demo import localstack
from tests.support import fork_server
from tests.support.fork_server import ForkedProcess

if sys.platform != "linux":
    pytest.skip("the suite forks services on Linux only (conftest.py)", allow_module_level=True)

PROBE = """
import atexit, json, os, sys, numpy
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "sid": os.getsid(0),
                  "marker": os.environ.get("FORK_TEST_MARKER"), "path0": sys.path[0],
                  "draw": int(numpy.random.randint(1 << 30)), "main": __name__}))
sys.stderr.write("to stderr\\n")
sys.exit(int(os.environ.get("FORK_TEST_EXIT", "0")))
"""


def _start(tmp_path: Path, argv: list[str], name: str = "out", **env: str) -> tuple[object, Path]:
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = fork_server.shared().popen(argv, env={**os.environ, **env}, cwd=tmp_path, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
    return proc, log


def _report(log: Path) -> dict[str, object]:
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


def test_a_forked_child_is_the_process_exec_would_start(tmp_path: Path) -> None:
    num_forked = fork_server.shared().num_forked
    proc, log = _start(tmp_path, [sys.executable, "-c", PROBE, "a", "b"], FORK_TEST_MARKER="x", FORK_TEST_EXIT="3")
    assert isinstance(proc, ForkedProcess) and fork_server.shared().num_forked == num_forked + 1
    assert proc.wait(timeout=60) == 3
    report = _report(log)
    assert report["argv"] == ["-c", "a", "b"] and report["marker"] == "x" and report["main"] == "__main__"
    assert report["cwd"] == str(tmp_path) and report["path0"] == ""
    assert report["pid"] == proc.pid and report["sid"] == proc.pid      # its own session, as start_new_session
    text = log.read_text()
    assert "to stderr" in text and "atexit ran" in text


def test_modules_and_console_scripts_run_with_their_argv(tmp_path: Path) -> None:
    proc, log = _start(tmp_path, [sys.executable, "-m", "block_manager.cli.main", "--help"])
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert "usage: block-manager" in log.read_text()
    script = Path(sys.executable).parent / "block-manager"
    if not script.exists():
        pytest.skip("no block-manager console script in this venv")
    proc, log = _start(tmp_path, ["block-manager", "--help"], name="script",
                       PATH=f"{script.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert "usage: block-manager" in log.read_text()


def test_signals_and_uncaught_errors_end_it_as_they_end_python(tmp_path: Path) -> None:
    sleeper, _ = _start(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"], name="sleep")
    assert sleeper.poll() is None
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(timeout=60) == -signal.SIGKILL
    failing, log = _start(tmp_path, [sys.executable, "-c", "raise ValueError('boom')"], name="fail")
    assert failing.wait(timeout=60) == 1
    assert "Traceback" in log.read_text() and "ValueError: boom" in log.read_text()
    slow = _start(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"], name="slow")[0]
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait(timeout=0.1)
    slow.kill()                                    # not left sleeping after the test
    assert slow.wait(timeout=60) == -signal.SIGKILL


def test_children_do_not_share_the_servers_random_state(tmp_path: Path) -> None:
    draws = set()
    for i in range(3):
        proc, log = _start(tmp_path, [sys.executable, "-c", PROBE], name=f"draw{i}")
        assert proc.wait(timeout=60) == 0
        draws.add(_report(log)["draw"])
    assert len(draws) == 3


def test_what_it_cannot_do_exactly_goes_to_popen(tmp_path: Path) -> None:
    server = fork_server.shared()
    mismatches, num_forked = dict(server.env_mismatches), server.num_forked
    piped = server.popen([sys.executable, "-c", "print('hi')"], stdout=subprocess.PIPE)
    assert isinstance(piped, subprocess.Popen) and piped.communicate(timeout=60)[0].strip() == b"hi"
    with open(tmp_path / "log", "wb") as out:
        for argv, env in (([sys.executable, "-u", "-c", "pass"], {}),                 # an interpreter option
                          (["true"], {}),                                           # not Python
                          ([sys.executable, "-c", "pass"], {"NUMBA_FORK_TEST": "1"})):  # NUMBA_*: read at import
            proc = server.popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
            assert isinstance(proc, subprocess.Popen), argv
            assert proc.wait(timeout=60) == 0
    # Only the environment's case is counted (the suite-cost line names it); none was forked.
    assert server.env_mismatches == {**mismatches, "NUMBA_FORK_TEST": mismatches.get("NUMBA_FORK_TEST", 0) + 1}
    assert server.num_forked == num_forked
    server.env_mismatches = mismatches       # this one was on purpose: not the line's business


def test_the_project_s_modules_come_from_the_child_s_path_and_log_by_its_environment(tmp_path: Path) -> None:
    """The server has the services' modules imported. A child logs at its own PAGEDKV_LOG_LEVEL
    (set up again, as its first import would); a `-m` entry module runs without runpy's
    "found in sys.modules" warning; and a child whose path finds another `pagedkv` (here one in
    its working directory) execs, and so imports that one."""
    code = ("from pagedkv.logging import get_logger; log = get_logger('probe'); "
            "log.info('hidden-info'); log.warning('shown-warning')")
    proc, log = _start(tmp_path, [sys.executable, "-c", code], name="levels", PAGEDKV_LOG_LEVEL="WARNING")
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert "shown-warning" in log.read_text() and "hidden-info" not in log.read_text()
    proc, log = _start(tmp_path, [sys.executable, "-m", "engine.api.cli", "--help"], name="module")
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert "usage: pagedkv-serve" in log.read_text() and "Warning" not in log.read_text()
    other = tmp_path / "pagedkv"
    other.mkdir()
    (other / "__init__.py").write_text("")
    proc, log = _start(tmp_path, [sys.executable, "-c", "import pagedkv; print(pagedkv.__file__)"], name="other")
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert log.read_text().strip() == str(other / "__init__.py")


def test_a_large_environment_arrives_whole(tmp_path: Path) -> None:
    """A request bigger than one socket read (the environment is sent with the command)."""
    big = "".join(chr(ord("a") + i % 26) for i in range(300_000))
    proc, log = _start(tmp_path, [sys.executable, "-c", "import os, hashlib; "
                                  "print(hashlib.sha256(os.environ['FORK_TEST_BIG'].encode()).hexdigest())"],
                       FORK_TEST_BIG=big)
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert log.read_text().strip() == hashlib.sha256(big.encode()).hexdigest()


def test_run_captures_like_subprocess_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fork_server.run`: the same CompletedProcess as `subprocess.run(capture_output=True)`,
    forked when the suite starts its services through the server and exec'd otherwise."""
    argv = [sys.executable, "-c", PROBE, "x"]
    env = {**os.environ, "FORK_TEST_EXIT": "4", "FORK_TEST_MARKER": "m"}
    forked_pids = []

    def through_server(*args: object, **kwargs: object) -> object:
        proc = fork_server.shared().popen(*args, **kwargs)
        forked_pids.append(isinstance(proc, ForkedProcess))
        return proc

    runs = []
    for start in (through_server, subprocess.Popen):
        monkeypatch.setattr(localstack, "start_process", start)
        runs.append(fork_server.run(argv, env=env, cwd=tmp_path, text=True, timeout=60))
    assert forked_pids == [True]                   # only the first went through the server
    for run in runs:
        assert run.returncode == 4 and run.stderr == "to stderr\n"
        report = json.loads(run.stdout.splitlines()[0])
        assert report["argv"] == ["-c", "x"] and report["marker"] == "m" and report["cwd"] == str(tmp_path)
        assert run.stdout.splitlines()[1] == "atexit ran"
    monkeypatch.setattr(localstack, "start_process", fork_server.shared().popen)
    with pytest.raises(subprocess.CalledProcessError):
        fork_server.run(argv, env=env, check=True, timeout=60)
    assert fork_server.run([sys.executable, "-c", "print('b')"], timeout=60).stdout == b"b\n"
    with pytest.raises(subprocess.TimeoutExpired):
        fork_server.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_a_client_in_another_process_forks_from_the_shared_server(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What an xdist worker does with the controller's server (`start_shared`): a `ForkServer`
    made from a running server's directory forks its children from that server; and when no
    server comes up there in time, it starts its own instead of failing."""
    own = fork_server.shared()
    server_dir = os.path.dirname(own._socket_path())
    ppid = [sys.executable, "-c", "import os; print(os.getppid())"]
    parents = set()
    for server in (own, fork_server.ForkServer(server_dir)):
        with open(tmp_path / "ppid", "wb") as out:
            proc = server.popen(ppid, stdout=out, stderr=subprocess.STDOUT)
            assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
        parents.add(int((tmp_path / "ppid").read_text()))
    assert len(parents) == 1 and parents != {os.getpid()}

    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "env.json").write_text(json.dumps(dict(os.environ)))
    started = []

    def start_own(env: dict[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
        started.append(env)          # where a real server would start (~3.5 CPU-s): stop here
        raise OSError("own server")

    monkeypatch.setattr(fork_server, "SHARED_WAIT_S", 0.2)
    monkeypatch.setattr(fork_server, "_start", start_own)
    with pytest.raises(OSError, match="own server"):
        fork_server.ForkServer(str(gone))._socket_path()
    assert started == [dict(os.environ)]   # with this process's environment, not the absent one's
