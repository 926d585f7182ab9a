"""Block manager server lifecycle: `grpc.aio` server, health, reflection, metrics, signals.

Start-up order matters: the listener, health (NOT_SERVING) and reflection come up first so
orchestrators can probe a recovering server; then the store is recovered off the event loop
(every RPC gets UNAVAILABLE meanwhile); only then does health turn SERVING. SIGTERM (or
SIGINT) flips health to NOT_SERVING, refuses new mutations with UNAVAILABLE, lets in-flight
RPCs finish within `shutdown_grace_s` (`server.stop(grace)`), writes a final snapshot and
releases the store lock. Nothing polls: lease expiry and defrag timeouts are timers.

    block-manager serve --config block_manager.yaml [--listen HOST:PORT] [--database-url URL]
    python -m block_manager.service.server --listen 127.0.0.1:0 --port-file /tmp/bm.port
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from block_manager.service.admin_servicer import BlockManagerAdminServicer
from block_manager.service.config import BlockManagerConfig, ConfigError, load_config
from block_manager.service.defrag_runner import DefragRunner
from block_manager.service.errors import RecoveryError
from block_manager.service.interceptors import AdminAuthInterceptor, ErrorMappingInterceptor
from block_manager.service.metrics import ServiceMetrics
from block_manager.service.runtime import Phase, ServiceRuntime
from block_manager.service.servicer import BlockManagerServicer
from block_manager.store import StoreError, StoreOptions, open_store
from block_manager.store.base import Store
from pagedkv.logging import configure_logging, get_logger
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

log = get_logger(__name__)

DATA_SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["BlockManagerAdmin"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class BlockManagerServer:
    """One block manager: construct, `await start()`, ..., `await stop()`."""

    def __init__(self, config: BlockManagerConfig, store: Store | None = None) -> None:
        self.config = config
        self._store = store
        self.metrics = ServiceMetrics()
        self.runtime: ServiceRuntime | None = None
        self.defrag: DefragRunner | None = None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopped = asyncio.Event()
        self.failed = asyncio.Event()   # set when the journal failed (fail-stop)

    def _open_store(self) -> Store:
        options = StoreOptions(
            request_retention_s=self.config.request_retention_s,
            max_retained_requests=self.config.max_retained_requests,
            lock_wait_s=self.config.store_lock_wait_s,
            sqlite_synchronous=self.config.sqlite_synchronous,
        )
        return open_store(self.config.database_url, options)

    async def start(self) -> None:
        cfg = self.config
        store = self._store or await asyncio.to_thread(self._open_store)
        # A server that opened "memory://" itself has nothing to recover later: skip the
        # journal entirely. A store passed in explicitly is always journaled.
        volatile = self._store is None and cfg.database_url.startswith("memory:")
        self.runtime = runtime = ServiceRuntime(cfg, store, journal=not volatile)
        self.defrag = DefragRunner(runtime, cfg.defrag)
        self.metrics.attach(runtime, asyncio.get_running_loop())
        runtime.on_phase(self._on_phase)

        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorMappingInterceptor(self.metrics)]
        if cfg.admin_token:  # each interceptor costs every call; no token, no auth layer
            interceptors.insert(0, AdminAuthInterceptor(cfg.admin_token))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(runtime, self.defrag), server)
        pb_grpc.add_BlockManagerAdminServicer_to_server(BlockManagerAdminServicer(runtime, self.defrag), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (DATA_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            port = server.add_insecure_port(cfg.listen_address)
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...")
            port = 0
        if port == 0:
            await asyncio.to_thread(store.close)
            raise OSError(f"cannot listen on {cfg.listen_address}")
        self.port = port
        await self._set_health(_NOT_SERVING)
        await server.start()
        self._server = server
        log.info("listening", address=cfg.listen_address, port=self.port)
        if cfg.metrics_port is not None:
            mport = self.metrics.serve(cfg.metrics_address, cfg.metrics_port)
            log.info("metrics endpoint", address=cfg.metrics_address, port=mport)
        try:
            await runtime.start()
        except RecoveryError:
            log.exception("recovery failed")
            await self.stop()
            raise
        self.defrag.arm_outstanding()
        await self._set_health(_SERVING)

    async def _set_health(self, status: int) -> None:
        for name in ("", DATA_SERVICE, ADMIN_SERVICE):
            await self.health.set(name, status)

    def _on_phase(self, phase: Phase) -> None:
        if phase != "serving":
            asyncio.get_running_loop().create_task(self._set_health(_NOT_SERVING))
        if phase == "failed":
            self.failed.set()

    @property
    def address(self) -> str:
        host = self.config.listen_address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.shutdown_grace_s if grace is None else grace
        if self.runtime is not None:
            self.runtime.begin_drain()
        await self._set_health(_NOT_SERVING)
        if self._server is not None:
            await self._server.stop(grace)
        if self.defrag is not None:
            self.defrag.close()
        if self.runtime is not None:
            await self.runtime.close()
        self.metrics.close()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(config: BlockManagerConfig, port_file: Path | None = None) -> int:
    server = BlockManagerServer(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await server.start()
    except (StoreError, RecoveryError, OSError) as exc:
        log.error("cannot start", error=str(exc))
        print(f"block-manager: error: {exc}", file=sys.stderr)
        return 1
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(server.port))
        os.replace(tmp, port_file)
    stop_wait = asyncio.create_task(stop_requested.wait())
    fail_wait = asyncio.create_task(server.failed.wait())
    await asyncio.wait((stop_wait, fail_wait), return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    fail_wait.cancel()
    if server.failed.is_set():
        # The in-memory state is ahead of the journal: exit so a supervisor restarts us
        # and recovery rebuilds exactly what was acknowledged.
        log.error("journal failed; exiting for a clean recovery")
        await server.stop(0)
        return 3
    log.info("signal received; shutting down", grace_s=config.shutdown_grace_s)
    await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="block-manager serve", description="Run the block manager gRPC service.")
    parser.add_argument("--config", type=Path, help="YAML config file (PAGEDKV_* environment variables override it)")
    parser.add_argument("--listen", help="listen address HOST:PORT (overrides config)")
    parser.add_argument("--database-url", help="store URL: sqlite:///FILE, postgresql+psycopg://..., memory://")
    parser.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: ephemeral)")
    parser.add_argument("--port-file", type=Path, help="write the bound gRPC port here once listening")
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in (
            ("listen_address", args.listen),
            ("database_url", args.database_url),
            ("metrics_port", args.metrics_port),
        )
        if v is not None
    }
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as exc:
        print(f"block-manager: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    return asyncio.run(serve(config, args.port_file))


if __name__ == "__main__":
    sys.exit(main())
