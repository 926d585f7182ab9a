"""Small helpers shared by the service tests (request builders, status assertions)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from block_manager.service.config import BlockManagerConfig
from block_manager.service.server import BlockManagerServer
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.support.configs import bm_test_config
from tests.support.polling import eventually  # noqa: F401 - re-exported for the service tests

_ids = itertools.count(1)


def rid(prefix: str = "r") -> str:
    """A fresh request id."""
    return f"{prefix}-{next(_ids)}"


def service_config(**overrides: Any) -> BlockManagerConfig:
    """Test defaults (`tests/support/configs.py`) with a short shutdown grace."""
    return bm_test_config(**{"shutdown_grace_s": 0.5, **overrides})


@dataclass(slots=True)
class Harness:
    server: BlockManagerServer
    channel: grpc.aio.Channel
    stub: pb_grpc.BlockManagerStub
    admin: pb_grpc.BlockManagerAdminStub

    async def register(self, node: str = "n1", num_blocks: int = 64, block_size: int = 0) -> pb.RegisterNodeResponse:
        return await self.stub.RegisterNode(
            pb.RegisterNodeRequest(
                request_id=rid("reg"),
                node_id=node,
                num_blocks=num_blocks,
                block_size=block_size,
                geometry=pb.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", device="cpu"),
                address="127.0.0.1:1",
            )
        )

    async def allocate(
        self, seq_id: str, pool: str = "n1", tokens: list[int] | None = None, num_tokens: int = 0, **kw: Any
    ) -> pb.AllocateOutcome:
        resp = await self.stub.Allocate(
            pb.AllocateRequest(
                request_id=kw.pop("request_id", rid("alloc")),
                items=[
                    pb.AllocateItem(seq_id=seq_id, pool_id=pool, token_ids=tokens or [], num_tokens=num_tokens, **kw)
                ],
            )
        )
        assert len(resp.outcomes) == 1
        return resp.outcomes[0]

    async def append(self, *items: tuple[str, int], request_id: str | None = None) -> pb.AppendSlotsResponse:
        return await self.stub.AppendSlots(
            pb.AppendSlotsRequest(
                request_id=request_id or rid("app"),
                items=[pb.AppendItem(seq_id=s, num_new_tokens=n) for s, n in items],
            )
        )

    async def fsck(self) -> list[str]:
        return list((await self.admin.Fsck(pb.FsckRequest())).problems)

    def state_snapshot(self) -> dict:
        assert self.server.runtime is not None
        return self.server.runtime.state.to_snapshot()


async def expect_code(coro: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, f"expected {code.name}, got {info.value.code().name}: {info.value.details()}"
    return info.value


