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

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from compute_node.service.config import ComputeNodeConfig
from compute_node.service.node import ComputeNode
from compute_node.service.servicer import ComputeNodeServicer
from compute_node.service.warmup import warm_up_cpu_kernels
from pagedkv.logging import get_logger
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

log = get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputeNode"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ComputeNodeServer:
    """One compute node: construct, `await start()`, ..., `await stop()`."""

    def __init__(self, config: ComputeNodeConfig) -> None:
        self.config = config
        self.health = health.aio.HealthServicer()
        self.node: ComputeNode | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_server: object | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        host = self.config.listen_address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
            ]
        )
        try:
            self.port = server.add_insecure_port(cfg.listen_address)
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...") on some versions
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {cfg.listen_address}")
        self.node = node = ComputeNode(cfg, advertise_address=cfg.advertise_address or self.address)
        node.on_registration = self._on_registration
        pb_grpc.add_ComputeNodeServicer_to_server(ComputeNodeServicer(node), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self._set_health(_NOT_SERVING)
        await server.start()
        self._server = server
        log.info("listening", address=cfg.listen_address, port=self.port, node_id=cfg.node_id)
        if cfg.metrics_port is not None:
            self._metrics_server, self.metrics_port = node.metrics.serve(cfg.metrics_address, cfg.metrics_port)
            log.info("metrics endpoint", address=cfg.metrics_address, port=self.metrics_port)
        if node.device.type == "cpu":
            g = cfg.geometry
            await asyncio.to_thread(warm_up_cpu_kernels, g.num_kv_heads, g.head_dim, g.dtype)
        node.start()

    def _on_registration(self, registered: bool) -> None:
        asyncio.get_running_loop().create_task(self._set_health(_SERVING if registered else _NOT_SERVING))

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self._set_health(_NOT_SERVING)
        if self._server is not None:
            await self._server.stop(grace)
        if self.node is not None:
            await self.node.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()  # type: ignore[attr-defined]
            self._metrics_server.server_close()  # type: ignore[attr-defined]
        log.info("stopped")


async def serve(config: ComputeNodeConfig, port_file: Path | None = None) -> int:
    server = ComputeNodeServer(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await server.start()
    except (OSError, ValueError) as exc:
        log.error("cannot start", error=str(exc))
        print(f"compute-node: error: {exc}", file=sys.stderr)
        return 1
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(server.port))
        os.replace(tmp, port_file)
    await stop_requested.wait()
    log.info("signal received; shutting down", grace_s=config.shutdown_grace_s)
    await server.stop()
    return 0
