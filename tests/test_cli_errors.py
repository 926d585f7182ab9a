"""What a newcomer's mistakes look like from the command line (issue 24): every case below is a
real process, and each ends with exactly one `prog: error: <what> (<hint>)` line on stderr, the
right exit code (2 usage, 1 runtime), no traceback, and nothing left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.compute_node.model.model_helpers import tiny_model_dir
from tests.support.http1 import http1_port

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "Exception ignored", "Event loop is closed", "never awaited", "add_port.cc", "CancelledError")
SERVE = [sys.executable, "-m", "engine.api.cli"]
BLOCK_MANAGER = [sys.executable, "-m", "block_manager.cli.main"]
COMPUTE_NODE = [sys.executable, "-m", "compute_node.service.cli", "serve"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("cli-models"), "llama", num_layers=1, hidden_size=64,
                          num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=512, seed=3)


@pytest.fixture(autouse=True)
def _environment_unchanged() -> Iterator[None]:
    """Some cases call a command's `main` in this process: none may leave the environment
    changed (a compute node's GOMP_SPINCOUNT did: this worker then no longer matched the shared
    fork server's environment, and every later service start fell back to a plain exec)."""
    def environment() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}    # pytest's own

    before = environment()
    yield
    assert environment() == before


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDKV_LOG_LEVEL": "WARNING"}


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=_env(), cwd=cwd or ROOT)


def _one_error(prog: str, result: subprocess.CompletedProcess[str], code: int) -> str:
    """The single error line; the exit code; nothing else on stderr."""
    for noise in NOISE:
        assert noise not in result.stderr, result.stderr[-3000:]
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr[-3000:]
    return lines[0]


def test_serve_port_out_of_range_is_a_usage_error(model_dir: Path) -> None:
    line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(model_dir), "--port", "99999"]), 2)
    assert "99999" in line and "0-65535" in line


def test_serve_busy_port_is_said_before_the_model_loads(model_dir: Path, busy_port: int) -> None:
    result = _run([*SERVE, "--model", str(model_dir), "--port", str(busy_port), "--log-level", "INFO"])
    line = _one_error("pagedkv-serve", result, 1)     # one line: not even the "serving" log came first
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line and "--port 0" in line


def test_serve_model_dir_problems_are_usage_errors_with_the_model_init_hint(tmp_path: Path) -> None:
    line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(tmp_path / "nope")]), 2)
    assert "does not exist" in line and "engine.model_init" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(empty)]), 2)
    assert "no config.json" in line and "engine.model_init" in line


def test_serve_dead_block_manager_is_one_plain_line(model_dir: Path) -> None:
    with socket.socket() as sock:                 # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(model_dir), "--block-manager",
                                             f"127.0.0.1:{port}"]), 1)
    assert f"cannot reach the block manager at 127.0.0.1:{port}" in line and "UNAVAILABLE" not in line
    with http1_port() as port:                   # the OpenAI server's port given instead
        line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(model_dir), "--port", "0", "--block-manager",
                                                 f"127.0.0.1:{port}"]), 1)
    assert f"127.0.0.1:{port} answers plain HTTP, not gRPC: not a block manager" in line


def test_compute_node_missing_model_is_exit_2_before_listening(tmp_path: Path) -> None:
    result = _run([*COMPUTE_NODE, "--listen", "127.0.0.1:0", "--block-manager", "127.0.0.1:9",
                   "--model", str(tmp_path / "nope")])
    line = _one_error("compute-node", result, 2)
    assert "does not exist" in line and "engine.model_init" in line


def test_block_manager_busy_port_leaves_no_database_behind(tmp_path: Path, busy_port: int) -> None:
    result = _run([*BLOCK_MANAGER, "serve", "--listen", f"127.0.0.1:{busy_port}",
                   "--database-url", f"sqlite:///{tmp_path / 'bm.db'}"])
    line = _one_error("block-manager", result, 1)
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line
    assert list(tmp_path.iterdir()) == []


def test_block_manager_failed_start_after_the_store_opened_removes_its_files(tmp_path: Path) -> None:
    """The TLS files are read once the store is open: the failed start takes bm.db and its
    lock away again."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    env = {**_env(), "PAGEDKV_TLS__CERT_FILE": str(junk), "PAGEDKV_TLS__KEY_FILE": str(junk)}
    result = subprocess.run([*BLOCK_MANAGER, "serve", "--listen", "127.0.0.1:0", "--database-url",
                             f"sqlite:///{tmp_path / 'bm.db'}"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "block-manager: error: " in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pem"]


def test_block_manager_listen_port_out_of_range_is_a_usage_error() -> None:
    line = _one_error("block-manager", _run([*BLOCK_MANAGER, "serve", "--listen", "127.0.0.1:99999",
                                             "--database-url", "memory://"]), 2)
    assert "0-65535" in line


def test_api_healthcheck_against_a_grpc_port_says_so(busy_port: int, tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    bm = subprocess.Popen([*BLOCK_MANAGER, "serve", "--listen", "127.0.0.1:0", "--database-url", "memory://",
                           "--port-file", str(port_file)], env=_env(), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert bm.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        result = _run([sys.executable, "-m", "engine.api.healthcheck", f"127.0.0.1:{port_file.read_text()}"])
    finally:
        bm.terminate()
        bm.wait(timeout=30)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.startswith("NOT HTTP") and "API server" in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_serve_shutdown_ends_open_streams_with_an_error_event(model_dir: Path, tmp_path: Path, sig: int) -> None:
    """SIGTERM / Ctrl-C with a stream open and a whole answer pending: the stream gets a final
    `server_shutdown` error event and `[DONE]`, the other request a 503, the server exits 0
    within its grace period, and stderr stays free of tracebacks. On the way: the API key from
    the environment (PAGEDKV_API_KEY) guards `/v1/*` and not `/health`."""
    port_file = tmp_path / "port"
    key = {"Authorization": "Bearer " + "k" * 16}
    proc = subprocess.Popen([*SERVE, "--model", str(model_dir), "--port", "0", "--port-file", str(port_file),
                             "--device", "cpu", "--num-kv-blocks", "512", "--block-size", "16",
                             "--log-level", "WARNING", "--shutdown-grace-s", "10"],
                            env={**_env(), "PAGEDKV_API_KEY": "k" * 16}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port_file.read_text()}"
        url = f"{base}/v1/completions"
        body = {"prompt": "the cache", "max_tokens": 4000, "ignore_eos": True}
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.post(url, json={**body, "max_tokens": 1}).status_code == 401
        whole: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: whole.append(httpx.post(url, json=body, headers=key, timeout=60)))
        waiting.start()
        with httpx.Client(timeout=60, headers=key) as client:
            with client.stream("POST", url, json={**body, "stream": True}) as stream:
                events = []
                for line in stream.iter_lines():
                    if line:
                        events.append(line)
                    if len(events) == 3:
                        proc.send_signal(sig)
                        signalled = time.monotonic()
            ended_s = time.monotonic() - signalled
        assert events[-1] == "data: [DONE]" and "server_shutdown" in events[-2], events[-3:]
        # Within the grace period by construction: past it uvicorn cancels the stream's task and the
        # client gets a bare connection error, not the server's own final event.
        print(f"stream ended {ended_s:.2f} s after the signal (grace 10 s)")
        waiting.join(timeout=30)
        assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutdown"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    for noise in NOISE:
        assert noise not in stderr, stderr[-3000:]


def test_demo_with_a_missing_model_is_a_usage_error_before_anything_starts(tmp_path: Path) -> None:
    result = _run([sys.executable, "-m", "demo.cli", "--model", str(tmp_path / "nope"),
                   "--plot", str(tmp_path / "p.svg")])
    line = _one_error("pagedkv-demo", result, 2)
    assert "does not exist" in line and "--model" in line


# Every command's usage errors, in this process (argparse's SystemExit, or its code returned): one line,
# exit 2, and a flag must be spelled out. argparse takes any unique prefix by default, so
# `block-manager serve --port 50051` quietly meant `--port-file 50051`: a file named 50051, the
# service on its default port.
UNKNOWN = "unrecognized arguments"      # where a prefix of a flag must not be taken for it
USAGE_CASES = [
    ("block_manager.cli.main", ["serve", "--bogus"], "block-manager serve", UNKNOWN),
    ("block_manager.cli.main", ["serve", "--port", "50051"], "block-manager serve", UNKNOWN),
    ("block_manager.cli.main", ["serve", "--metrics-port", "x"], "block-manager serve", "invalid int value"),
    ("block_manager.cli.main", ["db", "current", "--database"], "block-manager db", UNKNOWN),
    ("block_manager.cli.main", ["admin", "--js", "status"], "block-manager admin", UNKNOWN),
    ("block_manager.cli.main", ["admin", "status", "--bogus"], "block-manager admin", UNKNOWN),
    # a value its protobuf field cannot hold (it was a ValueError traceback from the request)
    ("block_manager.cli.main", ["admin", "seqs", "--limit", "-1"], "block-manager admin seqs",
     "argument --limit: must be in [0, 4294967295], got -1"),
    ("block_manager.cli.main", ["admin", "seqs", "--limit", str(1 << 32)], "block-manager admin seqs", "--limit"),
    ("block_manager.cli.main", ["admin", "events", "--follow", "--from", "-1"], "block-manager admin events",
     "argument --from"),
    ("block_manager.cli.main", ["admin", "--timeout", "nan", "status"], "block-manager admin", "--timeout"),
    ("pagedkv.healthcheck", ["--timeout", "-1", "127.0.0.1:1"], "python -m pagedkv.healthcheck", "seconds > 0"),
    ("engine.api.healthcheck", ["--timeout", "0", "127.0.0.1:1"], "python -m engine.api.healthcheck", "seconds > 0"),
    ("block_manager.cli.main", ["replay", "--bogus"], "block-manager replay", "required"),
    ("block_manager.cli.main", ["bogus"], "block-manager", "invalid choice"),
    ("compute_node.service.cli", ["serve", "--mod", "x"], "compute-node", UNKNOWN),
    ("engine.api.cli", ["--por", "80"], "pagedkv-serve", UNKNOWN),
    ("engine.api.cli", ["--shutdown-grace-s", "-1"], "pagedkv-serve", "seconds >= 0"),
    ("demo.cli", ["--bogus"], "pagedkv-demo", UNKNOWN),
    ("engine.model_init", [], "python -m engine.model_init", "required"),
    ("pagedkv.healthcheck", ["--time", "1", "127.0.0.1:1"], "python -m pagedkv.healthcheck", UNKNOWN),
    ("engine.api.healthcheck", ["--time", "1", "127.0.0.1:1"], "python -m engine.api.healthcheck", UNKNOWN),
]


@pytest.mark.parametrize(("module", "argv", "prog", "said"), USAGE_CASES,
                         ids=[" ".join(c[1]) or c[0] for c in USAGE_CASES])
def test_usage_errors_are_one_line_and_flags_are_not_abbreviated(module: str, argv: list[str], prog: str, said: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    try:
        code = importlib.import_module(module).main(argv)
    except SystemExit as exc:    # argparse's exit; some commands return its code instead
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and "--help)" in lines[0], err
    assert said in lines[0], err


@pytest.mark.parametrize("url", ["foo://x", "sqlite://", "sqlite:///:memory:", "not a url"])
def test_block_manager_bad_store_url_is_a_usage_error_before_anything_starts(
        url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked with the rest of the configuration: exit 2, no log line first, nothing written
    (it used to fail at run time, exit 1, between JSON log lines)."""
    from block_manager.service import server

    monkeypatch.chdir(tmp_path)
    code = server.main(["--database-url", url, "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("block-manager: error: invalid configuration: database_url: ") and err.count("\n") == 1, err
    assert "Value error" not in err      # pydantic's prefix of a validator's message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("flags", "said"), [
    (["--block-size", "0"], "block_size: Input should be greater than or equal to 1"),
    (["--device", "bogus"], "device: expected auto, cpu, cuda or cuda:N, got 'bogus'"),
    (["--disk-kv-bytes", "1000000"], "give both disk_kv_path and disk_kv_bytes"),    # was exit 1
])
def test_serve_bad_option_values_get_the_help_hint_not_the_model_one(model_dir: Path, flags: list[str],
                                                                     said: str) -> None:
    """A value the engine refuses is the flag's problem: no "make a tiny demo model" hint, no
    pydantic "1 validation error for ..." block."""
    line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(model_dir), "--port", "0", *flags]), 2)
    assert said in line and line.endswith("(see pagedkv-serve --help)") and "model_init" not in line


def test_compute_node_bad_block_manager_address_is_a_usage_error(model_dir: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked with the configuration (it was a run-time failure, exit 1, between log lines)."""
    from compute_node.service import cli

    # The CLI sets GOMP_SPINCOUNT when it is unset; set here, it is undone after the test
    # (see `_environment_unchanged`).
    monkeypatch.setenv("GOMP_SPINCOUNT", cli.NODE_SPINCOUNT)
    code = cli.main(["serve", "--model", str(model_dir), "--block-manager", "notanaddress", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("compute-node: error: invalid configuration: block_manager_address: "
                                 "bad address 'notanaddress': expected HOST:PORT\n"), err


def test_grpc_health_check_against_an_http_port_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The inverse of the API health check's gRPC-port case above."""
    from pagedkv import healthcheck

    with http1_port() as port:
        code = healthcheck.main([f"127.0.0.1:{port}", "--timeout", "5"])
    out = capsys.readouterr().out
    assert code == 1 and out.startswith("NOT_GRPC (the port answers plain HTTP") and "engine.api.healthcheck" in out
    code = healthcheck.main(["127.0.0.1:1", "--ca-file", str(tmp_path / "nope.pem")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("python -m pagedkv.healthcheck: error: ") and err.count("\n") == 1, err


def test_serve_kv_pool_too_big_is_one_line_with_the_flags_to_change(model_dir: Path) -> None:
    """torch's allocator message was the whole line before."""
    line = _one_error("pagedkv-serve", _run([*SERVE, "--model", str(model_dir), "--port", "0",
                                             "--num-kv-blocks", str(1 << 40)]), 1)
    assert "cannot allocate the KV pool on cpu" in line and "GiB" in line and "--num-kv-blocks" in line
