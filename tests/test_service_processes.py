"""What a user sees when starting either service as a process: the configured log level, and
one line plus a non-zero exit for a bad config file, a busy metrics port or a store directory
that does not exist (issue 10, "Configuration and errors a user sees")."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.localstack import ServiceProcess

BLOCK_MANAGER = [sys.executable, "-m", "block_manager.cli.main", "serve", "--listen", "127.0.0.1:0"]
COMPUTE_NODE = [
    sys.executable, "-m", "compute_node.service.cli", "serve", "--listen", "127.0.0.1:0",
    "--block-manager", "127.0.0.1:9",   # nothing listens there: the node keeps retrying
]
SERVICES = {"block-manager": BLOCK_MANAGER, "compute-node": COMPUTE_NODE}
NOISE = ("Traceback", "Event loop is closed", "never awaited", "Exception ignored")


def _run(argv: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _error_lines(prog: str, stderr: str) -> list[str]:
    for noise in NOISE:
        assert noise not in stderr, stderr[-2000:]
    return [line for line in stderr.splitlines() if line.startswith(f"{prog}: error:")]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _config(tmp_path: Path, prog: str, text: str) -> Path:
    path = tmp_path / f"{prog}.yaml"
    base = "database_url: memory://\n" if prog == "block-manager" else "device: cpu\nnum_blocks: 16\n"
    path.write_text(base + text)
    return path


@pytest.mark.parametrize("prog", SERVICES)
def test_malformed_yaml_is_one_line_and_exit_2(tmp_path: Path, prog: str) -> None:
    result = _run(SERVICES[prog], "--config", str(_config(tmp_path, prog, "log_level: [\n")))
    assert result.returncode == 2
    [line] = _error_lines(prog, result.stderr)
    assert "not valid YAML" in line and "at line" in line


@pytest.mark.parametrize("prog", SERVICES)
def test_busy_metrics_port_is_one_line_naming_the_port(prog: str, busy_port: int) -> None:
    result = _run(SERVICES[prog], "--metrics-port", str(busy_port), *(
        ["--database-url", "memory://"] if prog == "block-manager" else []
    ))
    assert result.returncode == 1
    [line] = _error_lines(prog, result.stderr)
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line


def test_sqlite_store_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    result = _run(BLOCK_MANAGER, "--database-url", f"sqlite:///{missing / 'x.db'}")
    assert result.returncode == 1
    [line] = _error_lines("block-manager", result.stderr)
    assert str(missing) in line and "does not exist" in line
    assert not missing.exists()
    # the one line is the last thing said, with no "stopped" event for a service that never ran
    assert result.stderr.strip().splitlines()[-1] == line and '"stopped"' not in result.stderr


@pytest.mark.parametrize("prog", SERVICES)
def test_log_level_from_the_config_file_takes_effect(tmp_path: Path, prog: str) -> None:
    config = _config(tmp_path, prog, "log_level: ERROR\n")
    service = ServiceProcess.start([*SERVICES[prog], "--config", str(config)], workdir=tmp_path, name=prog)
    assert service.stop(signal.SIGTERM) == 0
    assert service.log_path is not None
    levels = [json.loads(line)["level"] for line in service.log_path.read_text().splitlines() if line.startswith("{")]
    assert levels == [] or set(levels) <= {"error", "critical"}, levels


def test_configure_logging_moves_the_level_of_loggers_already_in_use() -> None:
    script = """
from pagedkv.logging import configure_logging, get_logger
log = get_logger("probe")
log.info("before")            # the logger is set up and cached at the default level
log.debug("hidden-debug")
configure_logging("DEBUG")
log.debug("shown-debug")
configure_logging("ERROR")
log.info("hidden-info")
log.warning("hidden-warning")
log.error("shown-error")
configure_logging()           # no level: keeps ERROR
log.info("hidden-later")
"""
    env = {"PATH": "/usr/bin:/bin", "PAGEDKV_LOG_LEVEL": "INFO"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert events == ["before", "shown-debug", "shown-error"], result.stderr


def test_ctrl_c_in_a_block_manager_command_is_one_line() -> None:
    """SIGINT while `block-manager admin` waits on a server that never answers: sent once the
    command has connected (its main is running), however slow a loaded machine starts it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        proc = subprocess.Popen(
            [sys.executable, "-m", "block_manager.cli.main", "admin", "--target",
             f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "120", "status"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            connected, _, _ = select.select([silent], [], [], 120)   # a pending connection: it waits on us
            assert connected and proc.poll() is None, "the command never connected"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130 and err.strip() == "block-manager: interrupted", err[-2000:]
