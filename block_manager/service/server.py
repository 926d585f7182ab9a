"""Block manager server lifecycle: `grpc.aio` server, health, reflection, metrics, signals.

Start-up order matters: the listener, health (NOT_SERVING) and reflection come up first so
orchestrators can probe a recovering server; then the store is recovered off the event loop
(every RPC gets UNAVAILABLE meanwhile); only then does health turn SERVING. SIGTERM (or
SIGINT) flips health to NOT_SERVING, refuses new mutations with UNAVAILABLE, lets in-flight
RPCs finish within `shutdown_grace_s` (`server.stop(grace)`), writes a final snapshot and
releases the store lock. Nothing polls: lease expiry and defrag timeouts are timers.

With `failover.enabled` (PostgreSQL) the server listens at once as a standby (every RPC
UNAVAILABLE, health NOT_SERVING) and takes the lead in the background when the database's
lock is free: recover, serve, ping the session; losing it stops the process (exit 3).
See service/leadership.py for the fencing argument.

    block-manager serve --config block_manager.yaml [--listen HOST:PORT] [--database-url URL] [--migrate]
    python -m block_manager.service.server --listen 127.0.0.1:0 --port-file /tmp/bm.port
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from block_manager.service import access, leadership
from block_manager.service.admin_servicer import BlockManagerAdminServicer
from block_manager.service.config import BlockManagerConfig, load_config
from block_manager.service.defrag_runner import DefragRunner
from block_manager.service.errors import RecoveryError
from block_manager.service.follower import JournalFollower
from block_manager.service.interceptors import ErrorMappingInterceptor
from block_manager.service.kv_events_zmq import ZmqKvEventPublisher
from block_manager.service.leadership import NotLeading
from block_manager.service.metrics import ServiceMetrics
from block_manager.service.runtime import Phase, ServiceRuntime
from block_manager.service.servicer import BlockManagerServicer
from block_manager.store import SqlStore, StoreError, StoreOptions, open_store
from block_manager.store.base import Store
from block_manager.store.reader import JournalReader
from pagedkv.auth import Authenticator
from pagedkv.cli import ArgumentParser
from pagedkv.guard import EdgeGuard
from pagedkv.lifecycle import (
    EXIT_START_FAILED,
    HealthReporter,
    TaskSet,
    address_with_port,
    bind,
    check_exposure,
    flag_overrides,
    install_health_and_reflection,
    limit_options,
    new_server,
    run_service_main,
    run_until_signal,
)
from pagedkv.logging import get_logger
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

log = get_logger(__name__)

DATA_SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["BlockManagerAdmin"].full_name
# Health of the process as a replica (leader or healthy standby), for orchestrator readiness;
# "" and the data services say SERVING on the leader only.
REPLICA_HEALTH = "pagedkv.block_manager.replica"
# How long a failed server lets in-flight calls receive their refusal before it stops.
FAILED_GRACE_S = 0.5
# How often a standby reads the journal's new records (its copy lags by at most this).
FOLLOW_INTERVAL_S = 0.2


class BlockManagerServer:
    """One block manager: construct, `await start()`, ..., `await stop()`."""

    def __init__(self, config: BlockManagerConfig, store: Store | None = None) -> None:
        self.config = config
        self._store = store
        self.metrics = ServiceMetrics()
        self.runtime: ServiceRuntime | None = None
        self.defrag: DefragRunner | None = None
        self.tasks = TaskSet("block-manager")
        self.health: HealthReporter | None = None
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopped = asyncio.Event()
        self.failed = asyncio.Event()  # set when the journal failed (fail-stop)
        # KV events in vLLM's format on ZMQ (kv_events.zmq_endpoint; service/kv_events_zmq.py)
        self.kv_events_zmq: ZmqKvEventPublisher | None = None

    def _open_store(self) -> Store:
        return open_store(self.config.database_url, self._store_options())

    def _store_options(self, **changes: Any) -> StoreOptions:
        options = StoreOptions(
            request_retention_s=self.config.request_retention_s,
            max_retained_requests=self.config.max_retained_requests,
            lock_wait_s=self.config.store_lock_wait_s,
            sqlite_synchronous=self.config.sqlite_synchronous,
            migrate=self.config.migrate,
        )
        return dataclasses.replace(options, **changes)

    def _open_leader_store(self) -> SqlStore:
        """One attempt to take the lead: waits up to 1 s for the lock, then `StoreLocked`."""
        store = open_store(
            self.config.database_url, self._store_options(lock_wait_s=1.0, leader_lease_s=self.config.failover.lease_s)
        )
        if not isinstance(store, SqlStore):   # the config allows failover on PostgreSQL only
            store.close()
            raise StoreError(f"failover needs a PostgreSQL store, not {type(store).__name__}")
        return store

    async def start(self) -> None:
        cfg = self.config
        # Active/standby: listen at once as a standby and take the lead in the background
        # (service/leadership.py); otherwise open (and lock) the store before listening.
        standby = self._store is None and cfg.failover.enabled
        store: Store
        if standby:
            store = NotLeading()
        elif self._store is not None:
            store = self._store
        else:
            store = await asyncio.to_thread(self._open_store)
        # A server that opened "memory://" itself has nothing to recover later: skip the
        # journal entirely. A store passed in explicitly is always journaled.
        volatile = self._store is None and cfg.database_url.startswith("memory:")
        self.runtime = runtime = ServiceRuntime(cfg, store, journal=not volatile, tasks=self.tasks)
        if standby:
            runtime.wait_as_standby()
        self.defrag = DefragRunner(runtime, cfg.defrag, self.tasks)
        self.metrics.attach(runtime, asyncio.get_running_loop())
        runtime.on_phase(self._on_phase)

        self.guard = edge_guard(cfg, self.metrics)
        server = new_server(
            [self.guard, ErrorMappingInterceptor(self.metrics)],
            options=limit_options(
                max_message_bytes=cfg.max_message_bytes, max_concurrent_streams=cfg.max_concurrent_streams
            ),
        )
        servicer = BlockManagerServicer(runtime, self.defrag, max_route_tokens=cfg.max_route_tokens)
        pb_grpc.add_BlockManagerServicer_to_server(servicer, server)
        pb_grpc.add_BlockManagerAdminServicer_to_server(BlockManagerAdminServicer(runtime, self.defrag), server)
        self.health = health = install_health_and_reflection(server, (DATA_SERVICE, ADMIN_SERVICE), self.tasks)
        try:
            self.port = bind(server, cfg.listen_address, cfg.tls)
            if cfg.kv_events.zmq_endpoint is not None:
                # before recovery: the hub's reset then sends the recovered view as a snapshot
                self.kv_events_zmq = ZmqKvEventPublisher.from_settings(
                    runtime.kv_events, cfg.kv_events, nodes=lambda: runtime.state.core.pool_ids)
                self.kv_events_zmq.start()
        except (OSError, ValueError):
            await asyncio.to_thread(store.close)
            raise
        check_exposure(cfg.listen_address, cfg.tls, cfg.auth_enabled, bool(cfg.auth.tokens))
        await health.set(False)
        await self._set_replica_health(True)
        await server.start()
        self._server = server
        log.info(
            "listening", address=cfg.listen_address, port=self.port, tls=cfg.tls.active,
            mtls=cfg.tls.require_client_cert, auth=cfg.auth_enabled, standby=standby,
        )
        if cfg.metrics_port is not None:
            mport = self.metrics.serve(cfg.metrics_address, cfg.metrics_port)
            log.info("metrics endpoint", address=cfg.metrics_address, port=mport)
        if standby:
            self.tasks.spawn(self._lead(), name="leadership")
            return
        try:
            await runtime.start()
        except RecoveryError:
            log.exception("recovery failed")
            await self.stop()
            raise
        self.defrag.arm_outstanding()
        await health.set(True)

    async def _lead(self) -> None:
        """Standby until the store's lock is ours; then recover and serve (leadership.py)."""
        runtime = self.runtime
        if runtime is None or self.defrag is None or self.health is None:
            return
        follower = JournalFollower(JournalReader(self.config.database_url), self.config.state_config(), runtime.clock,
                                   runtime.new_sessions)
        follow_stop = asyncio.Event()
        following = self.tasks.spawn(self._follow(follower, follow_stop), name="follow")
        try:
            store = await leadership.acquire(self._open_leader_store, self._stopped)
        except StoreError as exc:
            log.error("cannot take the lead", error=str(exc))
            runtime.fail(exc)
            return
        finally:
            follow_stop.set()
            await asyncio.wait([following])   # its worker thread is done with the copy
            warm = follower.warm()
            follower.close()
        if store is None:
            return
        if self._stopped.is_set():
            await asyncio.to_thread(store.close)
            return
        t0 = time.perf_counter()
        log.warning("leadership acquired", epoch=getattr(store, "epoch", None))
        loop = asyncio.get_running_loop()
        runtime.fence = store.leadership_fresh
        runtime.adopt_store(store)

        def on_lost(exc: BaseException) -> None:   # runs on the keepalive's thread
            loop.call_soon_threadsafe(self._leadership_lost, exc)
        store.start_keepalive(on_lost)
        try:
            await runtime.start(warm)
        except RecoveryError as exc:
            log.exception("recovery failed")
            runtime.fail(exc)
            return
        self.defrag.arm_outstanding()
        await self.health.set(True)
        log.warning(
            "serving as leader", epoch=getattr(store, "epoch", None), takeover_s=round(time.perf_counter() - t0, 3)
        )

    async def _follow(self, follower: JournalFollower, stop: asyncio.Event) -> None:
        """A standby keeps a warm copy of the leader's state (service/follower.py)."""
        warned = False
        while not stop.is_set():
            try:
                await asyncio.to_thread(follower.poll)
                if self.runtime is not None:
                    self.runtime.followed_seq_no = follower.seq_no
                warned = False
            except StoreError as exc:
                if not warned:
                    log.warning("standby cannot follow the journal yet", error=str(exc).splitlines()[0][:300])
                    warned = True
            try:
                await asyncio.wait_for(stop.wait(), FOLLOW_INTERVAL_S)
            except TimeoutError:
                pass

    def _leadership_lost(self, exc: BaseException) -> None:
        if self.runtime is not None and self.runtime.phase not in ("stopped", "failed"):
            log.error("leadership lost: the store session is gone; stopping", error=str(exc).splitlines()[0][:300])
            self.runtime.fail(exc)

    async def _set_replica_health(self, serving: bool) -> None:
        """`REPLICA_HEALTH`: SERVING while this process leads or stands by healthily (the
        orchestrator's readiness: a standby must not block a rolling update)."""
        if self.health is not None:
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.servicer.set(REPLICA_HEALTH, status)

    def _on_phase(self, phase: Phase) -> None:
        if phase != "serving" and self.health is not None:
            self.health.set_soon(False)
        if phase in ("failed", "draining", "stopped"):
            self.tasks.spawn(self._set_replica_health(False), name="replica-health")
        if phase == "failed":
            # Exit after a moment: calls already queued are dispatched meanwhile and refused
            # (UNAVAILABLE, retried elsewhere by clients) instead of ending CANCELLED.
            asyncio.get_running_loop().call_later(FAILED_GRACE_S, self.failed.set)

    @property
    def address(self) -> str:
        return address_with_port(self.config.listen_address, self.port)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.shutdown_grace_s if grace is None else grace
        if self.runtime is not None and self.runtime.phase == "failed":
            # Fail-stop: calls already in flight are refused (UNAVAILABLE: the phase is
            # "failed"), which a client retries elsewhere; cut off at once they would end
            # CANCELLED, which no client retries. Refusing takes microseconds.
            grace = max(grace, min(FAILED_GRACE_S, self.config.shutdown_grace_s))
        if self.runtime is not None:
            self.runtime.begin_drain()
        if self.health is not None:
            await self.health.set(False)
        if self._server is not None:
            await self._server.stop(grace)
        if self.defrag is not None:
            self.defrag.close()
        if self.runtime is not None:
            await self.runtime.close()
        if self.kv_events_zmq is not None:
            await asyncio.to_thread(self.kv_events_zmq.close)   # sends what is queued, closes its sockets
        await self.tasks.cancel_all()
        self.metrics.close()
        if self.runtime is not None:   # a start that failed before the store opened stopped nothing
            log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
        if self._server is not None:
            await self._server.wait_for_termination()


def edge_guard(cfg: BlockManagerConfig, metrics: ServiceMetrics | None = None) -> EdgeGuard:
    """The first interceptor: deadlines, identities (`access.authorize`), calls in flight per
    peer. With authentication off, the legacy `admin_token` alone still guards the admin plane."""
    authenticator: Authenticator | None = None
    guarded = None
    if cfg.auth_enabled:
        authenticator = Authenticator(cfg.auth, {"admin": cfg.admin_token})
    elif cfg.admin_token:
        authenticator = Authenticator(cfg.auth.model_copy(update={"cert_principals": {}, "cert_uri_prefix": ""}),
                                      {"admin": cfg.admin_token})
        guarded = access.is_admin_method
    on_refused = None
    if metrics is not None:
        on_refused = lambda method, code, seconds: metrics.observe_rpc(method, code.name, seconds)  # noqa: E731
    return EdgeGuard(
        authenticator=authenticator, authorize=access.authorize, guarded=guarded,
        max_inflight_per_peer=cfg.max_inflight_per_peer, on_refused=on_refused,
    )


async def serve(config: BlockManagerConfig, port_file: Path | None = None) -> int:
    """Run one block manager until a signal (exit 0) or a journal failure (exit 3). A start
    that fails removes the SQLite files it created (`bm.db`, its lock, WAL and shared memory),
    so a corrected retry starts from what was there before, and nothing is left to wonder about."""
    new_files = [p for p in _sqlite_files(config.database_url) if not p.exists()]
    server = BlockManagerServer(config)
    code = await run_until_signal(
        server,
        prog="block-manager",
        port_file=port_file,
        startup_errors=(StoreError, RecoveryError, OSError, ValueError),
        failed=server.failed,
        grace_s=config.shutdown_grace_s,
    )
    if code == EXIT_START_FAILED:
        for path in new_files:
            path.unlink(missing_ok=True)
    return code


def _sqlite_files(database_url: str) -> list[Path]:
    """The files an SQLite store at `database_url` may create; none for other stores."""
    try:
        url = make_url(database_url)
    except ArgumentError:
        return []
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return []
    path = Path(url.database).expanduser().resolve()
    return [path.with_name(path.name + suffix) for suffix in ("", ".lock", "-wal", "-shm", "-journal")]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="block-manager serve", description="Run the block manager gRPC service.")
    parser.add_argument("--config", type=Path, help="YAML config file (PAGEDKV_* environment variables override it)")
    parser.add_argument("--listen", help="listen address HOST:PORT (overrides config)")
    parser.add_argument("--database-url", help="store URL: sqlite:///FILE, postgresql+psycopg://..., memory://")
    parser.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: ephemeral)")
    parser.add_argument("--port-file", type=Path, help="write the bound gRPC port here once listening")
    parser.add_argument(
        "--migrate", action="store_true", default=None,
        help="upgrade an older store schema at start-up (default: refuse and name `block-manager db upgrade`)",
    )
    parser.add_argument("--kv-events-zmq", metavar="ENDPOINT",
                        help="publish KV events in vLLM's format on a ZMQ PUB socket bound here (tcp://HOST:PORT)")
    parser.add_argument("--kv-events-zmq-replay", metavar="ENDPOINT",
                        help="a ZMQ ROUTER socket bound here replays recent batches (vLLM's replay protocol)")
    parser.add_argument("--kv-events-zmq-topic", metavar="TEMPLATE",
                        help='the topic of each node\'s events, with "{node}" (default "kv@{node}")')
    parser.add_argument("--kv-events-zmq-format", choices=["map", "array"],
                        help="events as tagged maps (default: vLLM's current format) or positional arrays "
                        "(vLLM's earlier format)")
    args = parser.parse_args(argv)
    overrides = flag_overrides(
        (("listen_address", args.listen), ("database_url", args.database_url), ("metrics_port", args.metrics_port),
         ("migrate", args.migrate))
    )
    zmq_flags = flag_overrides((("zmq_endpoint", args.kv_events_zmq),
                                ("zmq_replay_endpoint", args.kv_events_zmq_replay),
                                ("zmq_topic", args.kv_events_zmq_topic),
                                ("zmq_event_format", args.kv_events_zmq_format)))
    if zmq_flags:
        overrides["kv_events"] = zmq_flags   # merged into the file's and the environment's kv_events
    return run_service_main(
        "block-manager",
        lambda: load_config(args.config, **overrides),
        lambda config: serve(config, args.port_file),
        lambda config: config.log_level,
    )


if __name__ == "__main__":
    sys.exit(main())
