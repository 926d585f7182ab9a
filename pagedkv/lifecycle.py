"""The one gRPC server lifecycle both services use: bind, health + reflection, background
tasks, the port file, signals, graceful stop and the process exit code.

A service object (`BlockManagerServer`, `ComputeNodeServer`) owns what is particular to it
(servicers, state, recovery); everything a process needs around it lives here, so the two
services start, report health, write their port and stop in exactly the same way.

Exit codes of `run_until_signal`: 0 after a signal-initiated graceful stop, 1 when start-up
failed (one line on stderr; whatever the failed start had set up is stopped first, so no
half-started gRPC server is left to the garbage collector), 130 for a Ctrl-C that arrives
before the signal handlers are installed, 3 when the service declared itself failed (e.g. the block
manager's journal could not be written: a supervisor restarts it and recovery rebuilds
exactly what was acknowledged).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.cli import error_line, port_problem, split_host_port
from pagedkv.logging import configure_logging, get_logger
from pagedkv.settings import ConfigError
from pagedkv.tls import TlsSettings, is_loopback, server_credentials

log = get_logger(__name__)

EXIT_OK = 0
EXIT_START_FAILED = 1
EXIT_USAGE = 2
EXIT_SERVICE_FAILED = 3
EXIT_INTERRUPTED = 130

C = TypeVar("C")


class Service(Protocol):
    """What `run_until_signal` needs of a service object."""

    port: int | None

    async def start(self) -> None: ...

    async def stop(self, grace: float | None = None) -> None: ...


class TaskSet:
    """Background tasks with a strong reference each (the event loop keeps only weak ones,
    so a fire-and-forget task can be garbage-collected mid-flight) and their failures logged
    instead of reported as "exception never retrieved" at some later collection."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", owner=self._name, task=task.get_name(), error=repr(task.exception()))

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class HealthReporter:
    """The standard gRPC health service for a fixed set of service names ("" included)."""

    def __init__(self, service_names: Iterable[str], tasks: TaskSet) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = ("", *service_names)
        self._tasks = tasks

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)

    def set_soon(self, serving: bool) -> None:
        """From synchronous callbacks running on the event loop."""
        self._tasks.spawn(self.set(serving), name="health-update")


def new_server(
    interceptors: Collection[grpc.aio.ServerInterceptor] = (), options: Mapping[str, Any] | None = None
) -> grpc.aio.Server:
    """A `grpc.aio` server that refuses to share its port (`so_reuseport` off): a second
    instance on the same address must fail to bind, not silently split the traffic."""
    opts = {"grpc.so_reuseport": 0, **(options or {})}
    return grpc.aio.server(interceptors=list(interceptors), options=list(opts.items()))


def limit_options(*, max_message_bytes: int, max_concurrent_streams: int | None) -> dict[str, Any]:
    """Server options for the resource limits both services configure: the largest message
    received or sent (a bigger one is refused with RESOURCE_EXHAUSTED before it is parsed) and
    the streams one HTTP/2 connection may have open at once (further calls wait client-side)."""
    opts: dict[str, Any] = {
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.max_send_message_length": max_message_bytes,
    }
    if max_concurrent_streams is not None:
        opts["grpc.max_concurrent_streams"] = max_concurrent_streams
    return opts


def bind(server: grpc.aio.Server, address: str, tls: TlsSettings | None = None) -> int:
    """Listen on `address` (with TLS when `tls` is active); the bound port (the real one when
    `address` ends in `:0`). A plaintext listener on a non-loopback address is logged loudly:
    anyone who can reach it can read and forge every call."""
    secure = tls is not None and tls.active
    credentials = server_credentials(tls) if tls is not None and secure else None
    try:
        port = server.add_secure_port(address, credentials) if secure else server.add_insecure_port(address)
    except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...") on some versions
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    if not secure and not is_loopback(address):
        log.warning(
            "PLAINTEXT LISTENER ON A NON-LOOPBACK ADDRESS: every call can be read and forged by anyone on the "
            "network; configure tls.cert_file / tls.key_file (and tls.require_client_cert) beyond development",
            address=address,
        )
    return port


def check_exposure(address: str, tls: TlsSettings | None, auth_enabled: bool, tokens: bool) -> None:
    """Log what a listener on `address` exposes: no authentication beyond loopback, or bearer
    tokens sent in cleartext."""
    if is_loopback(address):
        return
    secure = tls is not None and tls.active
    if not auth_enabled:
        log.warning(
            "NO AUTHENTICATION ON A NON-LOOPBACK ADDRESS: any peer may make any call; configure mutual TLS "
            "(tls.require_client_cert) or auth.tokens",
            address=address,
        )
    elif tokens and not secure:
        log.warning("bearer tokens travel in cleartext on this listener: configure TLS", address=address)


def install_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str], tasks: TaskSet
) -> HealthReporter:
    """Register health (starting NOT_SERVING once `set(False)` is awaited) and reflection."""
    names = tuple(service_names)
    reporter = HealthReporter(names, tasks)
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return reporter


# Young-generation threshold and generation ratios for long-lived servers (see `tune_gc`).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Call once the service's long-lived state is built (after recovery): move it out of the
    collector's sight (`gc.freeze`) and collect young objects less often. A server holding
    hundreds of thousands of table entries otherwise pays full collections that scan all of
    them in the middle of RPCs; measured with bench/bench_service.py `scale` (16 schedulers x
    256 sequences): step p99 66-70 ms tuned vs 98-164 ms default, same run (BENCHMARKS.md).
    Full collections still run (every 100 second-generation ones), so garbage cycles are not
    kept forever."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def address_with_port(listen_address: str, port: int | None) -> str:
    """`host:port` of a listener bound from `listen_address` (which may say port 0)."""
    return f"{listen_address.rsplit(':', 1)[0]}:{port}"


def write_port_file(path: Path, port: int) -> None:
    """Atomically publish the bound port (tests and the local stack wait for this file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


async def run_until_signal(
    service: Service,
    *,
    prog: str,
    port_file: Path | None = None,
    startup_errors: tuple[type[BaseException], ...] = (OSError, ValueError),
    failed: asyncio.Event | None = None,
    grace_s: float | None = None,
) -> int:
    """Start `service`, publish its port, serve until SIGTERM/SIGINT (graceful stop) or until
    `failed` is set (immediate stop); the process exit code."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await service.start()
    except startup_errors as exc:
        log.error("cannot start", error=str(exc))
        await _stop_quietly(service)
        # last, after whatever the stop logged: the line a person reads is the final one
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_START_FAILED
    if port_file is not None and service.port is not None:
        write_port_file(port_file, service.port)
    tune_gc()   # a service process: its state is built (recovered); embedded servers skip this
    waits = [asyncio.ensure_future(stop_requested.wait())]
    if failed is not None:
        waits.append(asyncio.ensure_future(failed.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if failed is not None and failed.is_set():
        log.error("service failed; exiting for a clean restart")
        await service.stop(0)
        return EXIT_SERVICE_FAILED
    log.info("signal received; shutting down", grace_s=grace_s)
    await service.stop()
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    """`OSError(98, "cannot serve metrics on ...: Address already in use")` prints as its
    message, not as "[Errno 98] ..."; any text is kept to its first line."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror and exc.errno else str(exc)
    return (text or type(exc).__name__).splitlines()[0]


async def _stop_quietly(service: Service) -> None:
    """Release what a failed start had already set up (a started gRPC server left to the
    garbage collector shuts down after the loop closed: "Event loop is closed" noise)."""
    try:
        await service.stop(0)
    except Exception as exc:  # noqa: BLE001 - the start failure is what the user must see
        log.warning("cleanup after a failed start failed", error=repr(exc))


def listen_problem(config: Any) -> str | None:
    """Why the config's gRPC listener (`listen_address`) or metrics endpoint (`metrics_address`,
    `metrics_port`) cannot listen, e.g. "cannot listen on 127.0.0.1:50051: address already in
    use"; None when both can (or are port 0 / absent). `ValueError` for a malformed address."""
    listeners = []
    address = getattr(config, "listen_address", None)
    if address:
        listeners.append(("cannot listen on", address, *split_host_port(address)))
    metrics_port = getattr(config, "metrics_port", None)
    if metrics_port:
        host = getattr(config, "metrics_address", "127.0.0.1")
        listeners.append(("cannot serve metrics on", f"{host}:{metrics_port}", host, int(metrics_port)))
    for what, text, host, port in listeners:
        problem = port_problem(host, port)
        if problem is not None:
            return f"{what} {text}: {problem}"
    return None


def flag_overrides(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Config overrides from command-line flags: only the flags that were given."""
    return {key: value for key, value in pairs if value is not None}


def run_service_main(
    prog: str,
    load: Callable[[], C],
    serve: Callable[[C], Coroutine[Any, Any, int]],
    log_level: Callable[[C], str],
) -> int:
    """The `serve` command of either service: config errors are one line and exit 2; a port
    that cannot be listened on is one line and exit 1, found before anything is opened or
    logged (no store file created, no gRPC bind noise); otherwise configure logging at the
    configured level and run `serve(config)`."""
    try:
        config = load()
    except ConfigError as exc:
        print(error_line(prog, str(exc)), file=sys.stderr)
        return EXIT_USAGE
    try:
        problem = listen_problem(config)
    except ValueError as exc:
        print(error_line(prog, str(exc), "listen addresses are HOST:PORT with a port in 0-65535"), file=sys.stderr)
        return EXIT_USAGE
    if problem is not None:
        print(error_line(prog, problem, "another server on that port? pick another port, or 0 for a free one"),
              file=sys.stderr)
        return EXIT_START_FAILED
    configure_logging(log_level(config))
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


__all__ = [
    "tune_gc",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SERVICE_FAILED",
    "EXIT_START_FAILED",
    "EXIT_USAGE",
    "HealthReporter",
    "Service",
    "TaskSet",
    "address_with_port",
    "bind",
    "check_exposure",
    "flag_overrides",
    "install_health_and_reflection",
    "limit_options",
    "listen_problem",
    "new_server",
    "run_service_main",
    "run_until_signal",
    "write_port_file",
]
