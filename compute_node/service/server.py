"""Compute node server lifecycle: `grpc.aio` server, health, reflection, metrics, signals.

The listener, health (NOT_SERVING) and reflection come up first, then the node registers its
pool in the background (retrying while the block manager is unreachable); health turns SERVING
when it is registered and back to NOT_SERVING while it is fenced and re-registering. SIGTERM
(or SIGINT) flips health to NOT_SERVING, lets in-flight forwards finish within
`shutdown_grace_s` (`server.stop(grace)`), then stops the heartbeat task. The lease is simply
left to expire: the block manager reclaims the pool's blocks when it does.

    compute-node serve --config compute_node.yaml [--listen HOST:PORT] [--block-manager HOST:PORT]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from compute_node.model import ModelLoadError
from compute_node.service import access
from compute_node.service.config import ComputeNodeConfig
from compute_node.service.interceptors import ErrorMappingInterceptor
from compute_node.service.node import ComputeNode
from compute_node.service.servicer import ComputeNodeServicer
from compute_node.service.warmup import warm_up_cpu_kernels
from pagedkv.auth import Authenticator
from pagedkv.guard import EdgeGuard
from pagedkv.lifecycle import (
    HealthReporter,
    TaskSet,
    address_with_port,
    bind,
    check_exposure,
    install_health_and_reflection,
    limit_options,
    new_server,
    run_until_signal,
)
from pagedkv.logging import get_logger
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

log = get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputeNode"].full_name


def edge_guard(cfg: ComputeNodeConfig) -> EdgeGuard:
    """Deadlines, identities (`access.authorize`: Forward from schedulers only), calls in
    flight per peer."""
    return EdgeGuard(
        authenticator=Authenticator(cfg.auth) if cfg.auth_enabled else None,
        authorize=access.authorize,
        max_inflight_per_peer=cfg.max_inflight_per_peer,
    )


class ComputeNodeServer:
    """One compute node: construct, `await start()`, ..., `await stop()`."""

    def __init__(self, config: ComputeNodeConfig) -> None:
        self.config = config
        self.tasks = TaskSet("compute-node")
        self.health: HealthReporter | None = None
        self.node: ComputeNode | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_server: Any = None   # prometheus_client's WSGI server (untyped)
        self._stopped = False

    @property
    def address(self) -> str:
        return address_with_port(self.config.listen_address, self.port)

    async def start(self) -> None:
        cfg = self.config
        self.guard = edge_guard(cfg)
        server = new_server(
            [self.guard, ErrorMappingInterceptor()],
            options=limit_options(
                max_message_bytes=cfg.max_message_bytes, max_concurrent_streams=cfg.max_concurrent_streams
            ),
        )
        self.port = bind(server, cfg.listen_address, cfg.tls)
        check_exposure(cfg.listen_address, cfg.tls, cfg.auth_enabled, bool(cfg.auth.tokens))
        advertise = cfg.advertise_address or self.address
        if advertise.endswith(":0"):  # "whatever port I bound": a listener on port 0 advertises the real one
            advertise = address_with_port(advertise, self.port)
        self.node = node = ComputeNode(cfg, advertise_address=advertise)
        pb_grpc.add_ComputeNodeServicer_to_server(ComputeNodeServicer(node), server)
        self.health = health = install_health_and_reflection(server, (SERVICE_NAME,), self.tasks)
        node.on_registration = health.set_soon
        await health.set(False)
        await server.start()
        self._server = server
        log.info(
            "listening", address=cfg.listen_address, port=self.port, node_id=cfg.node_id, tls=cfg.tls.active,
            mtls=cfg.tls.require_client_cert, auth=cfg.auth_enabled,
        )
        if cfg.metrics_port is not None:
            self._metrics_server, self.metrics_port = node.metrics.serve(cfg.metrics_address, cfg.metrics_port)
            log.info("metrics endpoint", address=cfg.metrics_address, port=self.metrics_port)
        await node.step_thread.run(node.load_model)
        if node.device.type == "cpu":
            g = node.geometry or cfg.geometry
            await node.step_thread.run(warm_up_cpu_kernels, g.num_kv_heads, g.head_dim, g.dtype)
        node.start()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace is None else grace
        if self.health is not None:
            await self.health.set(False)
        if self._server is not None:
            await self._server.stop(grace)
        if self.node is not None:
            await self.node.stop()
        await self.tasks.cancel_all()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        log.info("stopped")


async def serve(config: ComputeNodeConfig, port_file: Path | None = None) -> int:
    """Run one compute node until a signal (exit 0)."""
    return await run_until_signal(
        ComputeNodeServer(config), prog="compute-node", port_file=port_file, grace_s=config.shutdown_grace_s,
        startup_errors=(OSError, ValueError, ModelLoadError),   # a bad --model is one line, exit 1
    )
