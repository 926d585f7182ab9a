"""Start the suite's service processes by forking an interpreter that has torch & co. imported.

Why: most of the CPU the test suite's service processes cost is Python start-up, not service
work: `import torch` alone is ~2 CPU-s on the 2-core CI VM, and a compute node costs ~2.7 CPU-s
before it serves a request; the suite starts ~100 service processes. A fork server (one per
test process, started on first use; in an xdist run one for the whole run, started by the
controller while the workers collect, `start_shared`) imports the third-party libraries and the
services' own modules once; each service is then a `fork()` of it that runs the command as `python` would: a
real, separate process with its own pid, session, working directory, environment, log file and
exit status, killed and stopped by signals like any other; its stdin is /dev/null.

The project's modules have no import-time state but the logging set-up (`pagedkv.logging`
reads PAGEDKV_LOG_LEVEL and whether stderr is a TTY when the first module asks for a logger):
the child sets it up again from its own environment and stderr, as its first import would
have. A command's own `-m` module is dropped before it runs, as `python -m` finds it unimported
(runpy would warn). And a child whose `sys.path` would find the project elsewhere (another
checkout) execs the command instead: it then imports that code, as `exec` would.

Commands it cannot run exactly as `exec` would are started with `subprocess.Popen` instead:
anything that is not this interpreter running `-m module`, `-c code` or a console script of
this venv; Python options (`-u`, `-X ...`); pipes; and an environment that differs from the
server's in a variable the pre-imported libraries read at import time (NUMBA_*, OMP_*, ...).
The CLI tests that check what a user's shell runs call `subprocess` themselves and never come
here. `PAGEDKV_TEST_FORK_SERVER=0` turns it off.

Protocol (a Unix socket per process started): the client sends one JSON line (argv, env,
cwd, new session) with its stdout/stderr descriptors attached (SCM_RIGHTS); the server answers
`{"pid": N}` once the child has its session and descriptors, and `{"status": S}` (a wait
status) when the child ends. The server is single-threaded (a select loop), so forking it is
safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

# What the services import from outside the project (the rest costs little). Nothing here may
# start OpenMP or threads: fork() after either is unsafe.
PRE_IMPORTS = (
    "torch", "numpy", "numba", "llvmlite.binding", "grpc", "grpc.aio", "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection", "google.protobuf.json_format", "sqlalchemy", "sqlalchemy.orm",
    "sqlalchemy.dialects.sqlite", "sqlalchemy.dialects.postgresql", "alembic.command", "alembic.runtime.migration",
    "structlog", "pydantic", "pydantic_settings", "prometheus_client", "safetensors.torch", "tokenizers",
    "fastapi", "uvicorn", "yaml", "xxhash",
)
# The services' entry points and what they import (~0.15 CPU-s of the project's own modules per
# service, ~0.25 for a compute node). Not the `-m` modules themselves: see `_run`.
PROJECT_PRE_IMPORTS = ("block_manager.service.server", "block_manager.cli.admin", "compute_node.service.server",
                       "engine.api.server", "engine.llm")
PROJECT_PACKAGES = ("block_manager", "compute_node", "demo", "engine", "kernels", "pagedkv")
# Read once, at import, by a pre-imported library: a child must see the server's values.
IMPORT_TIME_ENV_PREFIXES = ("NUMBA_", "OMP_", "GOMP_", "MKL_", "OPENBLAS_", "KMP_", "TORCH_", "PYTORCH_",
                            "CUDA_", "GRPC_", "LD_", "PYTHON")
CHILD_SET_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")     # applied in the child


# ---- server (runs as `python fork_server.py SOCKET`) ------------------------------------------
def serve(socket_path: str) -> None:
    # libgomp reads its settings once, when torch loads it: do before that what every compute
    # node's CLI does (a short spin), or forked nodes would spin as libgomp's default does.
    from compute_node.service.cli import short_omp_spin
    short_omp_spin(os.environ)
    for name in PRE_IMPORTS:
        with contextlib.suppress(ImportError):
            __import__(name)
    for name in PROJECT_PRE_IMPORTS:
        __import__(name)
    _prepare_for_children()
    base_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".bound")
    listener.listen(64)
    # Under its name once it accepts: a client that finds the path can connect (see `_wait_for`).
    os.rename(socket_path + ".bound", socket_path)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return                        # the test process closed the pipe: done
        if listener in readable:
            conn, _ = listener.accept()
            try:
                children[_fork_one(conn, listener, children, base_path)] = conn
            except (OSError, ValueError, KeyError):    # a bad or half-sent request: the client sees EOF
                conn.close()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()


def _prepare_for_children() -> None:
    """Work every service would repeat after the fork, done once here (~0.4 CPU-s per child).

    - Numba's CPU target loads its typing and lowering registries on a process's first compile
      or cache load (~0.2-0.3 CPU-s). This starts no threads: the OpenMP pool starts with the
      first parallel kernel, which never runs here.
    - Every service calls `pagedkv.lifecycle.tune_gc` once it is up: a full collection, then
      `gc.freeze`. A full collection walks every object the pre-imports made (~250,000,
      ~0.2 CPU-s); frozen here, they are out of each child's collections, as they are out of
      the server's. Frozen objects are never freed, and these live as long as the server.
    """
    import gc

    with contextlib.suppress(ImportError):
        from numba.core.registry import cpu_target
        cpu_target.typing_context.refresh()
        cpu_target.target_context.refresh()
    gc.collect()
    gc.freeze()


def _fork_one(conn: socket.socket, listener: socket.socket, children: Mapping[int, socket.socket],
              base_path: list[str]) -> int:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    while not data.endswith(b"\n"):                    # the rest of a long request (a big env)
        chunk = conn.recv(1 << 16)
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise ValueError("the request ended early")
        data += chunk
    if len(fds) != 2:
        raise ValueError("a request carries stdout and stderr")
    request = json.loads(data)
    # The pid goes back once the child is set up (its own session, its fds), as Popen returns
    # after the exec: a caller may signal the process group at once.
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        for fd in fds:
            os.close(fd)
        os.read(ready_r, 1)                               # b"" if it died first: its status follows
        os.close(ready_r)
        with contextlib.suppress(OSError):                # a client gone: the child runs on, reaped later
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        return pid
    try:                                                  # the child: never returns
        os.close(ready_r)
        listener.close()
        conn.close()
        for other in children.values():
            other.close()
        _become(request, fds, base_path)
        os.write(ready_w, b"1")
        os.close(ready_w)
    except BaseException:                                 # noqa: BLE001 (reported, then the exit)
        import traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(_run(request))


def _become(request: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """Turn the forked server into the process `exec` would have started."""
    if request["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # sys.stdin/stdout/stderr already write to fds 0-2, now /dev/null and the log; a fresh
    # interpreter would line-buffer stderr always and stdout under PYTHONUNBUFFERED.
    sys.stdout.reconfigure(line_buffering=bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.stderr.reconfigure(line_buffering=True)
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[:] = [request["path0"], *_pythonpath(os.environ), *base_path]
    with contextlib.suppress(ImportError):
        import numpy
        numpy.random.seed()              # as a fresh interpreter would: not the server's state
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _adopt_project_modules(request: dict[str, Any]) -> None:
    """Keep the server's imports of the project only if this child's `sys.path` finds the same
    files (else exec the command: it imports its own), and set logging up for this child."""
    for name in PROJECT_PACKAGES:
        module = sys.modules.get(name)
        if module is None:
            continue
        # The finders an import would ask, in order (sys.path's, and an editable install's).
        spec = next(filter(None, (getattr(finder, "find_spec", lambda *_: None)(name, None)
                                  for finder in sys.meta_path)), None)
        if spec is None or spec.origin != module.__file__:
            flag = {"module": ["-m"], "code": ["-c"], "script": []}[request["kind"]]
            os.execv(sys.executable, [sys.executable, *flag, request["target"], *request["args"]])
    import logging

    import structlog

    from pagedkv import logging as pagedkv_logging

    structlog.reset_defaults()
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    pagedkv_logging._configured = False                   # noqa: SLF001 (as in a fresh interpreter)
    pagedkv_logging.configure_logging()                  # what the first `get_logger` at import does


def _run(request: dict[str, Any]) -> int:
    """Run the command in this process as `python` would, ending as Python ends."""
    import runpy
    import types

    kind, target, args = request["kind"], request["target"], request["args"]
    _adopt_project_modules(request)
    code = 0
    try:
        if kind == "module":
            sys.argv = [target, *args]                    # run_module puts the file in argv[0]
            sys.modules.pop(target, None)                 # `python -m` finds it unimported
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "code":
            sys.argv = ["-c", *args]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)   # noqa: S102 (what `python -c` does)
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)               # as Python does: killed by SIGINT
    except BaseException:                                 # noqa: BLE001 (an uncaught error: traceback, 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    return code


def _finish() -> None:
    """Python's shutdown, in its order: join non-daemon threads, atexit, flush."""
    import atexit
    threading._shutdown()                                 # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _pythonpath(env: Mapping[str, str]) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# ---- client (in the test process) -------------------------------------------------------------
class ForkedProcess:
    """The parts of `subprocess.Popen` the suite uses, for a child of the fork server."""

    def __init__(self, args: Sequence[str], conn: socket.socket) -> None:
        self.args = list(args)
        self.stdin = self.stdout = self.stderr = None
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()
        started = self._message(timeout=60)
        if "pid" not in started:
            raise OSError(f"the fork server could not start {self.args}")
        self.pid = int(started["pid"])

    def _message(self, timeout: float | None) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            chunk = self._conn.recv(4096)
            if not chunk:                 # the server went away: the child's status is lost
                return {"status": signal.SIGKILL}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):     # another thread is waiting: it will know
            return self.returncode
        try:
            return self._wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            return self._wait(timeout)

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            status = int(self._message(timeout)["status"])
            self.returncode = os.waitstatus_to_exitcode(status)
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


class ForkServer:
    """One per test process, or one per xdist run shared by its workers (`start_shared`);
    `popen` is a drop-in for `subprocess.Popen` (see the module doc).

    `shared_dir`: the directory of a server another process started (its socket and the
    environment it was started with); if that server is not up within `SHARED_WAIT_S`, this
    one starts its own on first use, as without it.
    """

    def __init__(self, shared_dir: str | None = None) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._env = dict(os.environ)     # the server's: what its pre-imported libraries read
        self._lock = threading.Lock()
        self._shared_dir = shared_dir
        # Counted for the suite-cost line: a start that falls back to exec only because the
        # environment differs is silent otherwise (a test that leaked GOMP_SPINCOUNT into its
        # worker's environment made every later service start of that worker a plain exec).
        self.num_forked = 0
        self.env_mismatches: dict[str, int] = {}
        if shared_dir is not None:
            with open(os.path.join(shared_dir, "env.json")) as f:
                self._env = json.load(f)

    def popen(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdin: Any = None, stdout: Any = None, stderr: Any = None,
              start_new_session: bool = False, **kwargs: Any) -> Any:
        env = dict(os.environ if env is None else env)
        command = None if kwargs or stdin not in (None, subprocess.DEVNULL) else _command(list(map(str, args)), env)
        fds = _out_fds(stdout, stderr)
        differs = [] if command is None or fds is None else self._env_differences(env)
        for key in differs:
            self.env_mismatches[key] = self.env_mismatches.get(key, 0) + 1
        if command is None or fds is None or differs:
            return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                    start_new_session=start_new_session, **kwargs)
        cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
        kind, target, rest = command
        path0 = {"module": cwd, "code": "", "script": os.path.dirname(target)}[kind]
        request = {"kind": kind, "target": target, "args": rest, "env": env, "cwd": cwd, "path0": path0,
                   "new_session": start_new_session}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._socket_path())
        payload = json.dumps(request).encode() + b"\n"
        sent = socket.send_fds(conn, [payload], fds)
        conn.sendall(payload[sent:])                      # a stream socket may take part of it
        process = ForkedProcess(args, conn)
        self.num_forked += 1
        return process

    def _env_differences(self, env: Mapping[str, str]) -> list[str]:
        """The variables read at import time whose value differs from the server's."""
        keys = {k for k in (*env, *self._env) if k.startswith(IMPORT_TIME_ENV_PREFIXES) and k not in CHILD_SET_ENV}
        return sorted(k for k in keys if env.get(k) != self._env.get(k))

    def _socket_path(self) -> str:
        with self._lock:
            if self._shared_dir is not None:
                shared = os.path.join(self._shared_dir, "s")
                if _wait_for(shared, SHARED_WAIT_S):
                    return shared
                self._shared_dir, self._env = None, dict(os.environ)    # not up: run our own
            if self._proc is None or self._proc.poll() is not None:
                self._dir, self._proc = _start(self._env)
                if self._proc.stdout is None or self._proc.stdout.readline() != b"ready\n":
                    raise RuntimeError("the fork server did not start")
            return os.path.join(self._dir or "", "s")

    def close(self) -> None:
        """Stop the server and reap it (its children's CPU then counts as this process's)."""
        with self._lock:
            if self._proc is not None:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                self._proc.wait(timeout=30)
                if self._proc.stdout is not None:
                    self._proc.stdout.close()
                self._proc = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


# The directory of the xdist controller's server, for its workers (set before they start).
SHARED_DIR_ENV = "PAGEDKV_TEST_FORK_SERVER_DIR"
# How long a worker waits for the controller's server to come up: it starts with the run and
# is up in a few seconds, long before a worker's first service (after collection).
SHARED_WAIT_S = 60.0
_shared: ForkServer | None = None


def shared() -> ForkServer:
    """This test process's fork server: the run's shared one in an xdist worker (one
    interpreter's imports instead of one per worker: ~3.5 CPU-s each), else its own, started on
    first use."""
    global _shared
    if _shared is None:
        shared_dir = os.environ.get(SHARED_DIR_ENV)
        _shared = ForkServer(shared_dir if shared_dir and os.path.isdir(shared_dir) else None)
    return _shared


def start_shared() -> ForkServer:
    """Start a server for the processes this one starts next (the xdist controller's workers:
    `SHARED_DIR_ENV` is set in this process's environment, which they inherit) without waiting
    for it to be ready. The caller closes it after they are done; its children's CPU then
    counts as the caller's (`shared().close()`)."""
    global _shared
    server = ForkServer()
    with server._lock:
        server._dir, server._proc = _start(server._env)
    os.environ[SHARED_DIR_ENV] = server._dir
    _shared = server
    return server


def _start(env: dict[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
    """A new server's directory (its socket, once up, and the environment it started with, for
    a client in another process) and its process."""
    directory = tempfile.mkdtemp(prefix="pagedkv-fork-")
    with open(os.path.join(directory, "env.json"), "w") as f:
        json.dump(env, f)
    proc = subprocess.Popen([sys.executable, __file__, os.path.join(directory, "s")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    return directory, proc


def _wait_for(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def run(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
        timeout: float | None = None, text: bool = False, check: bool = False) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run(args, capture_output=True, ...)` for a test's helper process whose point is
    what it computes, not how a user's shell starts it: started as the suite starts its services
    (`demo.localstack.start_process`, this process's fork server when the suite uses one). A
    forked child gets descriptors, not pipes, so the output is captured in files and read back."""
    from demo import localstack

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = localstack.start_process(list(args), env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            data = f.read()
            captured.append(data.decode(errors="replace") if text else data)
    result = subprocess.CompletedProcess(list(args), proc.returncode, *captured)
    if check:
        result.check_returncode()
    return result


def _command(argv: list[str], env: Mapping[str, str]) -> tuple[str, str, list[str]] | None:
    """(kind, target, args) for a command this interpreter runs without options, else None."""
    if not argv:
        return None
    if _same_interpreter(argv[0], env):
        if len(argv) >= 3 and argv[1] == "-m":
            return "module", argv[2], argv[3:]
        if len(argv) >= 3 and argv[1] == "-c":
            return "code", argv[2], argv[3:]
        return None
    script = shutil.which(argv[0], path=env.get("PATH"))
    if script is None:
        return None
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!") or not _same_interpreter(first[2:].decode(errors="replace").strip(), env):
        return None
    return "script", os.path.abspath(script), argv[1:]


def _same_interpreter(path: str, env: Mapping[str, str]) -> bool:
    """`path` is this interpreter: the same file, or a link to it in the same venv (python3)."""
    found = shutil.which(path, path=env.get("PATH")) if os.sep not in path else path
    if found is None:
        return False
    found, ours = os.path.abspath(found), os.path.abspath(sys.executable)
    return found == ours or (os.path.dirname(found) == os.path.dirname(ours)
                             and os.path.realpath(found) == os.path.realpath(ours))


def _out_fds(stdout: Any, stderr: Any) -> list[int] | None:
    """The descriptors for the child's stdout and stderr, or None for what it cannot pass (pipes)."""
    def fd(stream: Any, inherit: int) -> int | None:
        if stream is None:
            return inherit
        if isinstance(stream, int) and stream >= 0:
            return stream
        if hasattr(stream, "fileno"):
            return stream.fileno()
        return None

    out = fd(stdout, 1)
    if out is None:
        return None
    err = out if stderr == subprocess.STDOUT else fd(stderr, 2)
    return None if err is None else [out, err]


if __name__ == "__main__":
    serve(sys.argv[1])
