"""Run the services of `docker-compose.yml` as local processes, exactly as written there.

This machine class has no container engine, and a compose file that nobody runs drifts from
the code. So the integration tests and the demo start each service with the `command` and
`environment` of its compose entry, changing only what a container network changes:

- a service's own container ports become port 0 on 127.0.0.1 at its first start (the kernel
  picks a free port: no probe-then-bind race) and the command gets `--port-file`, from which
  the stack learns the gRPC port the service actually bound; a restart reuses that port, so
  clients and dependants reconnect to the same address, as they would in compose;
- other services' host names (`block-manager:50051`) become `127.0.0.1:<its bound port>`, so
  dependants start after their dependencies published their ports (compose's `depends_on`);
- an environment variable named `*_PORT` whose value is one of the service's container ports
  becomes that port's local counterpart, 0 (ephemeral) for ports other than the gRPC one;
- a named volume's mount path (`/data`) becomes a directory under the stack's work dir, and a
  bind mount's (`${PAGEDKV_CERTS_DIR:-./certs/dev}:/certs:ro`) the host directory it names
  (relative paths from the compose file's directory);
- override files (`docker-compose.mtls.yml`) merge onto the base file as `docker compose -f
  base -f override` does: mappings merge key by key, `volumes` by mount path, `ports` add up,
  other lists (`command`, a health check's `test`) are replaced;
- `${VAR:-default}` is interpolated from the given environment, as compose does;
- the health check's `["CMD", "python", ...]` runs with this interpreter and the service's
  environment (as inside its container: a probe may read the service's own TLS settings), and
  so does a command that starts with `python`;
- a one-shot service (one that others depend on with `condition:
  service_completed_successfully`, such as `model-init`) runs to completion before its
  dependants start, and a non-zero exit stops the stack from coming up, as in compose.

Processes get their own session (SIGKILL reaches the whole service) and their output goes to
`<workdir>/<service>.log`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pagedkv.cli import ctrl_c_deferred

COMPOSE_FILE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
MTLS_COMPOSE_FILE = COMPOSE_FILE.with_name("docker-compose.mtls.yml")
# How every service process here starts (subprocess.Popen's signature and handle). The test
# suite puts a fork server's in its place (tests/support/fork_server.py): its processes skip
# Python's ~2.7 CPU-s start-up with torch, and the suite starts ~100 of them.
start_process: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen
_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


class StackError(RuntimeError):
    """A service would not start, or became unhealthy."""


@dataclass(slots=True)
class ServiceSpec:
    """One compose service, as written (after `${...}` interpolation)."""

    name: str
    command: list[str]
    environment: dict[str, str]
    container_ports: list[int]
    volumes: dict[str, str]            # volume name -> mount path in the container
    healthcheck: list[str] | None
    depends_on: list[str]
    profiles: list[str]
    binds: dict[str, str] = field(default_factory=dict)   # mount path in the container -> host path
    oneshot: bool = False              # a job others wait for to complete (no ports, no health check)


def _mount_target(entry: object) -> str:
    return str(entry).split(":")[1] if ":" in str(entry) else str(entry)


def merge_compose(base: dict, override: dict) -> dict:
    """`override` merged onto `base` as compose merges `-f base -f override` files."""
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            out[key] = merge_compose(old, value)
        elif key == "volumes" and isinstance(old, list) and isinstance(value, list):
            targets = {_mount_target(v) for v in value}
            out[key] = [v for v in old if _mount_target(v) not in targets] + list(value)
        elif key == "ports" and isinstance(old, list) and isinstance(value, list):
            out[key] = old + [v for v in value if v not in old]
        else:
            out[key] = value
    return out


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` substitution (unset or empty -> default)."""
    return _INTERP.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def load_compose(
    path: Path = COMPOSE_FILE, env: Mapping[str, str] | None = None, overrides: Sequence[Path] = ()
) -> dict[str, ServiceSpec]:
    env = dict(os.environ if env is None else env)
    doc = yaml.safe_load(Path(path).read_text())
    for extra in overrides:
        doc = merge_compose(doc, yaml.safe_load(Path(extra).read_text()))
    base_dir = Path(path).resolve().parent
    specs: dict[str, ServiceSpec] = {}
    oneshots = {dep for svc in doc["services"].values() if isinstance(svc.get("depends_on"), dict)
                for dep, cond in svc["depends_on"].items()
                if isinstance(cond, dict) and cond.get("condition") == "service_completed_successfully"}
    for name, svc in doc["services"].items():
        if "command" not in svc:
            continue                     # third-party image services (postgres) run their own entrypoint
        environment = {k: interpolate(str(v), env) for k, v in (svc.get("environment") or {}).items()}
        ports = [int(str(p).split(":")[-1].split("/")[0]) for p in svc.get("ports") or []]
        volumes, binds = {}, {}
        for v in svc.get("volumes") or []:
            source, _, target = interpolate(str(v), env).partition(":")
            if source.startswith((".", "/", "~")):      # a bind mount of a host path
                binds[target.split(":")[0]] = str((base_dir / Path(source).expanduser()).resolve())
            else:
                volumes[source] = target.split(":")[0]
        test = (svc.get("healthcheck") or {}).get("test")
        depends = svc.get("depends_on") or {}
        depends_on = [d for d, cond in (depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends))
                      if not (isinstance(cond, dict) and cond.get("required") is False)]
        specs[name] = ServiceSpec(
            name=name,
            command=[interpolate(str(c), env) for c in svc["command"]],
            environment=environment,
            container_ports=ports,
            volumes=volumes,
            healthcheck=[interpolate(str(c), env) for c in test[1:]] if test and test[0] == "CMD" else None,
            depends_on=depends_on,
            profiles=list(svc.get("profiles") or []),
            binds=binds,
            oneshot=name in oneshots,
        )
    return specs


def wait_port_file(port_file: Path, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> int:
    """The port a service published in its `--port-file` (it writes the file once listening)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise StackError(f"{' '.join(map(str, proc.args))} exited with code {proc.returncode} before listening")
        time.sleep(0.02)
    raise StackError(f"no port file {port_file} after {timeout_s:.0f} s")


@dataclass(slots=True)
class ServiceProcess:
    """One service process started with `--listen 127.0.0.1:0 --port-file F`: the race-free way
    to run a service on a free port (tests and benchmarks). Use as a context manager."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        argv: list[str],
        *,
        workdir: Path,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timeout_s: float = 120.0,
    ) -> ServiceProcess:
        """Run `argv + ["--port-file", ...]` (argv must listen on port 0) and wait for its port."""
        workdir.mkdir(parents=True, exist_ok=True)
        port_file = workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log_path = workdir / f"{name}.log"
        with open(log_path, "ab") as log, ctrl_c_deferred():
            proc = start_process(
                [*argv, "--port-file", str(port_file)], env=dict(env) if env is not None else None, cwd=cwd,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            port = wait_port_file(port_file, proc, timeout_s)
        except BaseException:   # a start-up failure, or Ctrl-C: nobody else knows this process
            _terminate(proc, signal.SIGKILL, 10)
            raise
        return cls(proc, port, log_path)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Signal the process group and wait (SIGKILL if it overstays); the exit code."""
        return _terminate(self.proc, sig, timeout_s)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen[bytes], sig: int, timeout_s: float) -> int | None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
    return proc.returncode


@dataclass(slots=True)
class _Running:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LocalStack:
    """The compose services as local processes; use as a context manager."""

    workdir: Path
    compose_file: Path = COMPOSE_FILE
    interp_env: Mapping[str, str] | None = None
    # Override files merged onto `compose_file` in order (`docker-compose.mtls.yml`).
    override_files: Sequence[Path] = ()
    # Extra environment per service, applied on top of the compose file's (tests use it for
    # short lease TTLs; the compose file stays what production runs).
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    specs: dict[str, ServiceSpec] = field(init=False)
    ports: dict[tuple[str, int], int] = field(init=False, default_factory=dict)
    running: dict[str, _Running] = field(init=False, default_factory=dict)
    completed: set[str] = field(init=False, default_factory=set)    # one-shot services that succeeded

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.specs = load_compose(self.compose_file, self.interp_env, self.override_files)

    # -- addressing ---------------------------------------------------------------------------
    def address(self, service: str, container_port: int | None = None) -> str:
        """`127.0.0.1:<port>` where the service's (first, gRPC) container port is reachable;
        known once the service has started."""
        spec = self.specs[service]
        port = container_port if container_port is not None else spec.container_ports[0]
        mapped = self.ports.get((service, port))
        if mapped is None:
            raise StackError(f"{service} has not published port {port} (start it first)")
        return f"127.0.0.1:{mapped}"

    def port_file(self, service: str) -> Path:
        return self.workdir / f"{service}.port"

    def rewrite(self, service: str, value: str, key: str = "") -> str:
        spec = self.specs[service]
        if key.endswith("_PORT") and value.isdigit() and int(value) in spec.container_ports:
            return str(self.ports.get((service, int(value)), 0))

        def host_port(m: re.Match[str]) -> str:
            host, port = m.group(1), int(m.group(2))
            own = host in ("0.0.0.0", "127.0.0.1", "localhost", service)
            target = service if own else host
            mapped = self.ports.get((target, port))
            if mapped is not None:
                return f"127.0.0.1:{mapped}"
            if own and port in spec.container_ports:
                return "127.0.0.1:0"  # first start: the kernel picks; the port file tells
            if target in self.specs:
                raise StackError(f"{service} needs {target}:{port}, which has not published its port yet")
            return m.group(0)

        value = re.sub(r"([A-Za-z0-9_.\-]+):(\d{2,5})\b", host_port, value)
        if value == "0.0.0.0":
            value = "127.0.0.1"
        for volume, mount in spec.volumes.items():
            if mount in value:
                value = value.replace(mount, str(self.volume_dir(volume)))
        for mount, host in spec.binds.items():
            if value == mount or value.startswith(mount + "/"):
                value = host + value[len(mount):]
        return value

    def volume_dir(self, volume: str) -> Path:
        path = self.workdir / "volumes" / volume
        path.mkdir(parents=True, exist_ok=True)
        return path

    def command(self, service: str) -> tuple[list[str], dict[str, str]]:
        """The local command line and full environment the service is started with."""
        spec = self.specs[service]
        env = dict(os.environ)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        for k, v in spec.environment.items():
            env[k] = self.rewrite(service, v, k)
        env.update(self.overrides.get(service, {}))
        argv = [self.rewrite(service, a) for a in spec.command]
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        if not spec.oneshot:
            argv += ["--port-file", str(self.port_file(service))]
        return argv, env

    # -- life cycle ---------------------------------------------------------------------------
    def run_once(self, service: str, timeout_s: float = 300.0) -> None:
        """Run a one-shot service to completion (`StackError` with its log on a failure)."""
        argv, env = self.command(service)
        log_path = self.workdir / f"{service}.log"
        with open(log_path, "ab") as log:
            try:
                code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=self.workdir, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                raise StackError(f"{service} did not finish in {timeout_s:.0f} s:\n{self.log_tail(service)}") from None
        if code != 0:
            raise StackError(f"{service} exited with code {code}:\n{self.log_tail(service)}")
        self.completed.add(service)

    def start(self, service: str, *, wait: bool = True, timeout_s: float = 120.0) -> None:
        if self.specs[service].oneshot:
            self.run_once(service)
            return
        if service in self.running and self.running[service].proc.poll() is None:
            raise StackError(f"{service} is already running")
        argv, env = self.command(service)
        port_file = self.port_file(service)
        port_file.unlink(missing_ok=True)
        log_path = self.workdir / f"{service}.log"
        with open(log_path, "ab") as log, ctrl_c_deferred():   # started and recorded (stopped by down())
            proc = start_process(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir)
            self.running[service] = _Running(self.specs[service], proc, log_path, env)
        try:
            port = wait_port_file(port_file, proc, timeout_s)
        except StackError as exc:
            raise StackError(f"{exc}\n{self.log_tail(service)}") from None
        self.ports[(service, self.specs[service].container_ports[0])] = port
        if wait:
            self.wait_healthy(service, timeout_s)

    def up(self, services: list[str] | None = None, timeout_s: float = 180.0) -> None:
        """Start services (default: all without a profile) in `depends_on` order."""
        wanted = services or [n for n, s in self.specs.items() if not s.profiles]
        started: set[str] = set()
        healthy: set[str] = set()     # probed once: each probe is a process (~0.3 CPU-s)

        def visit(name: str) -> None:
            if name in started or name not in self.specs:
                return
            for dep in self.specs[name].depends_on:
                visit(dep)
            if self.specs[name].oneshot:
                self.run_once(name)
            else:
                self.start(name, wait=False)
            started.add(name)
            # dependants need this one healthy first (condition: service_healthy)
            if not self.specs[name].oneshot and any(name in s.depends_on for s in self.specs.values()):
                self.wait_healthy(name, timeout_s)
                healthy.add(name)

        for name in wanted:
            visit(name)
        for name in wanted:
            if not self.specs[name].oneshot and name not in healthy:
                self.wait_healthy(name, timeout_s)

    def is_healthy(self, service: str) -> bool:
        spec = self.specs[service]
        if spec.healthcheck is None:
            return self.running[service].proc.poll() is None
        argv = [sys.executable if a == "python" else self.rewrite(service, a) for a in spec.healthcheck]
        env = self.running[service].env or None
        return subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, env=env
        ).returncode == 0

    def wait_healthy(self, service: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        run = self.running[service]
        while time.monotonic() < deadline:
            if run.proc.poll() is not None:
                raise StackError(f"{service} exited with code {run.proc.returncode}:\n{self.log_tail(service)}")
            if self.is_healthy(service):
                return
            time.sleep(0.2)
        raise StackError(f"{service} not healthy after {timeout_s:.0f} s:\n{self.log_tail(service)}")

    def log_tail(self, service: str, num_lines: int = 30) -> str:
        path = self.workdir / f"{service}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])

    def kill(self, service: str, sig: int = signal.SIGKILL) -> None:
        run = self.running.get(service)
        if run is not None:
            _terminate(run.proc, sig, 30)

    def stop(self, service: str, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (graceful `stop(grace)` in the services), SIGKILL if it overstays."""
        run = self.running.get(service)
        return None if run is None else _terminate(run.proc, signal.SIGTERM, timeout_s)

    def down(self) -> dict[str, int | None]:
        """Stop everything, dependants first; returns each service's exit code."""
        codes: dict[str, int | None] = {}
        for name in reversed(list(self.running)):
            codes[name] = self.stop(name)
        return codes

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
