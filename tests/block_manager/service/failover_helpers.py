"""Real block-manager processes in active/standby on one PostgreSQL database (tests only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from demo.localstack import ServiceProcess
from tests.support.polling import eventually

REPO = Path(__file__).resolve().parents[3]


def server_env(lease_s: float) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PAGEDKV_BLOCK_SIZE": "4",
        "PAGEDKV_SNAPSHOT_EVERY_RECORDS": "50",   # the new leader recovers snapshot + replay
        "PAGEDKV_LEASE_TTL_S": "120",
        "PAGEDKV_DEFRAG__ENABLED": "false",
        "PAGEDKV_MAX_UNSETTLED_STEPS": "64",
        "PAGEDKV_FAILOVER__ENABLED": "true",
        "PAGEDKV_FAILOVER__LEASE_S": str(lease_s),
        "PAGEDKV_SHUTDOWN_GRACE_S": "0.5",
    }


def start_server(url: str, tmp: Path, name: str, lease_s: float) -> ServiceProcess:
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0", "--database-url", url]
    return ServiceProcess.start(argv, workdir=tmp, name=name, env=server_env(lease_s), cwd=REPO, timeout_s=60)


async def health(address: str, service: str = "") -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = await health_pb2_grpc.HealthStub(ch).Check(request, timeout=2)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_serving(address: str, timeout_s: float = 60.0) -> None:
    async def serving() -> bool:
        return await health(address) == "SERVING"

    await eventually(serving, timeout_s=timeout_s, interval_s=0.05, what=f"{address} SERVING")
