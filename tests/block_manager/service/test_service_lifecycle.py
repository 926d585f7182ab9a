"""Server lifecycle: config sources, restart on the same file (request ids answered from
the store after a snapshot), journal failure → fail-stop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from block_manager.service.config import ConfigError, load_config
from block_manager.service.server import BlockManagerServer, main
from block_manager.store import MemoryStore, NewRecord, StoreOptions
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import (
    Harness,
    eventually,
    expect_code,
    rid,
    service_config,
    step_request,
)


def test_config_yaml_env_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "bm.yaml"
    cfg_file.write_text("block_size: 32\nlease_ttl_s: 3\ndefrag:\n  every_n_steps: 50\nadmin_token: abc\n")
    monkeypatch.setenv("PAGEDKV_LEASE_TTL_S", "7")
    monkeypatch.setenv("PAGEDKV_DEFRAG__TIMEOUT_S", "4")
    cfg = load_config(cfg_file, metrics_port=0)
    assert (cfg.block_size, cfg.lease_ttl_s, cfg.admin_token, cfg.metrics_port) == (32, 7.0, "abc", 0)
    assert (cfg.defrag.every_n_steps, cfg.defrag.timeout_s) == (50, 4.0)
    assert cfg.state_config().default_block_size == 32
    cfg_file.write_text("block_size: 0\nbogus: 1\n")
    with pytest.raises(ConfigError, match="block_size") as info:
        load_config(cfg_file)
    assert "bogus" in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    assert main(["--config", str(cfg_file)]) == 2


async def _open(url: str, **overrides: Any) -> tuple[BlockManagerServer, grpc.aio.Channel, pb_grpc.BlockManagerStub]:
    server = BlockManagerServer(service_config(database_url=url, **overrides))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return server, channel, pb_grpc.BlockManagerStub(channel)


async def test_restart_answers_request_ids_covered_by_a_snapshot(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bm.db'}"
    server, channel, stub = await _open(url, snapshot_every_records=2)
    await stub.RegisterNode(pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=32))
    alloc = step_request(request_id="early", allocs=[("a", "n1", None, 5, None, 0)])
    first = await stub.Step(alloc)
    steps = [
        step_request(request_id=f"step-{i}", appends=[("a", 1)], reports={"n1": (1, i + 1, 0)}) for i in range(4)
    ]
    for req in steps:
        await stub.Step(req)
    await channel.close()
    await server.stop(0)  # graceful: final snapshot, so nothing is replayed on restart

    server, channel, stub = await _open(url)
    try:
        assert server.runtime is not None and server.runtime.num_replayed == 0
        assert await stub.Step(alloc) == first  # from the store's request index
        await stub.Step(steps[0])
        admin = pb_grpc.BlockManagerAdminStub(channel)
        assert (await admin.DescribeSequence(pb.DescribeSequenceRequest(seq_id="a"))).table.num_tokens == 9
        other = step_request(request_id="early", allocs=[("b", "n1", None, 5, None, 0)])
        await expect_code(stub.Step(other), grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        await channel.close()
        await server.stop(0)


class FlakyStore(MemoryStore):
    """A memory store whose appends start failing on demand."""

    def __init__(self) -> None:
        super().__init__(StoreOptions())
        self.broken = False

    def append(self, records: Sequence[NewRecord]) -> list[int]:
        if self.broken:
            raise OSError("disk on fire")
        return super().append(records)


async def test_journal_failure_stops_serving(tmp_path: Path) -> None:
    store = FlakyStore()
    server = BlockManagerServer(service_config(), store=store)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h = Harness(server, channel, pb_grpc.BlockManagerStub(channel), pb_grpc.BlockManagerAdminStub(channel))
    try:
        await h.register("n1")
        store.broken = True
        await expect_code(h.allocate("a", num_tokens=1), grpc.StatusCode.UNAVAILABLE)
        await expect_code(h.allocate("b", num_tokens=1), grpc.StatusCode.UNAVAILABLE)
        health = health_pb2_grpc.HealthStub(channel)

        async def not_serving() -> bool:
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            return status == health_pb2.HealthCheckResponse.NOT_SERVING

        await eventually(not_serving)
        assert (await h.admin.Status(pb.StatusRequest())).state == "failed"
    finally:
        await channel.close()
        await server.stop(0)


class SlowRecoveryStore(MemoryStore):
    """A memory store whose `recover()` blocks until the test releases it."""

    def __init__(self) -> None:
        super().__init__(StoreOptions())
        self.release = threading.Event()

    def recover(self) -> Any:
        if not self.release.wait(timeout=30):
            raise TimeoutError("test never released recovery")
        return super().recover()


async def test_not_serving_while_recovering() -> None:
    store = SlowRecoveryStore()
    server = BlockManagerServer(service_config(), store=store)
    starting = asyncio.create_task(server.start())
    try:
        while server.port is None or server._server is None:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = pb_grpc.BlockManagerStub(channel)
            await expect_code(
                stub.RegisterNode(pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=8)),
                grpc.StatusCode.UNAVAILABLE,
            )
            admin = pb_grpc.BlockManagerAdminStub(channel)
            assert (await admin.Status(pb.StatusRequest())).state == "recovering"
            store.release.set()
            await starting
            assert (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == health_pb2.HealthCheckResponse.SERVING
            await stub.RegisterNode(pb.RegisterNodeRequest(request_id=rid(), node_id="n1", num_blocks=8))
    finally:
        store.release.set()
        await starting
        await server.stop(0)


async def test_address_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = BlockManagerServer(service_config(listen_address=f"127.0.0.1:{port}"))
        with pytest.raises(OSError, match="cannot listen"):
            await server.start()
