"""Fixtures of the block manager service tests: an in-process server on 127.0.0.1:0."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from block_manager.service.server import BlockManagerServer
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import Harness, service_config


@pytest.fixture
async def start_server() -> AsyncIterator[Callable[..., Any]]:
    """`await start_server(**config_overrides)` -> Harness; everything is stopped at teardown."""
    started: list[Harness] = []

    async def start(**overrides: Any) -> Harness:
        server = BlockManagerServer(service_config(**overrides))
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        h = Harness(server, channel, pb_grpc.BlockManagerStub(channel), pb_grpc.BlockManagerAdminStub(channel))
        started.append(h)
        return h

    yield start
    for h in started:
        await h.channel.close()
        await h.server.stop(0)


@pytest.fixture
async def harness(start_server: Callable[..., Any]) -> Harness:
    return await start_server()
