"""Small helpers shared by the service tests (request builders, status assertions)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
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
SCHEDULER = "sched-test"


def rid(prefix: str = "r") -> str:
    """A fresh request id."""
    return f"{prefix}-{next(_ids)}"


def service_config(**overrides: Any) -> BlockManagerConfig:
    """Test defaults (`tests/support/configs.py`) with a short shutdown grace."""
    return bm_test_config(**{"shutdown_grace_s": 0.5, **overrides})


AllocItem = tuple  # (seq_id, pool, tokens | None, num_tokens, salt | None, num_compute)


def step_request(
    *,
    scheduler_id: str = SCHEDULER,
    reports: dict[str, tuple[int, int, int]] | None = None,
    frees: list[str] = (),  # type: ignore[assignment]
    allocs: list[AllocItem] = (),  # type: ignore[assignment]
    written: list[tuple[str, int]] = (),  # type: ignore[assignment]
    forks: list[tuple[str, list[str]]] = (),  # type: ignore[assignment]
    appends: list[tuple[str, int] | tuple[str, int, list[int]]] = (),  # type: ignore[assignment]
    request_id: str | None = None,
    pool_epochs: dict[str, int] | None = None,
    release: bool = False,
) -> pb.StepRequest:
    """A Step request from plain values (what the client library builds, spelled out)."""
    m = pb.StepRequest(request_id=request_id if request_id is not None else rid("step"), scheduler_id=scheduler_id)
    m.pool_epochs.update(pool_epochs or {})
    for pool, (epoch, done, failed) in (reports or {}).items():
        m.reports.add(pool_id=pool, epoch=epoch, completed_up_to=done, failed_from=failed)
    m.free_seq_ids.extend(frees)
    pools: dict[str, int] = {}
    salts: dict[str, int] = {}
    for seq_id, pool, tokens, num_tokens, salt, num_compute in allocs:
        m.alloc_seq_ids.append(seq_id)
        m.alloc_pool_index.append(pools.setdefault(pool, len(pools)))
        m.alloc_salt_index.append(-1 if salt is None else salts.setdefault(salt, len(salts)))
        m.alloc_num_token_ids.append(len(tokens) if tokens else 0)
        m.alloc_token_ids.extend(tokens or [])
        m.alloc_num_tokens.append(0 if tokens else num_tokens)
        m.alloc_num_compute.append(num_compute or 0)
    m.pool_ids.extend(pools)
    m.salts.extend(salts)
    for seq_id, n in written:
        m.written_seq_ids.append(seq_id)
        m.written_num_tokens.append(n)
    for parent, children in forks:
        m.fork_parent_ids.append(parent)
        m.fork_num_children.append(len(children))
        m.fork_child_ids.extend(children)
    for item in appends:
        m.append_seq_ids.append(item[0])
        m.append_num_tokens.append(item[1])
        if len(item) > 2:
            m.append_token_ids.extend(item[2])  # type: ignore[misc]
    m.release_leases = release
    return m


def item_errors(resp: pb.StepResponse, section: str) -> dict[int, pb.ItemError]:
    """The failed items of one section, by index."""
    return {e.index: e for e in resp.errors if e.section == section}


@dataclass(slots=True)
class Harness:
    server: BlockManagerServer
    channel: grpc.aio.Channel
    stub: pb_grpc.BlockManagerStub
    admin: pb_grpc.BlockManagerAdminStub
    # pool -> (epoch, completed_up_to, 0): the Forwards `step` reports with the next step
    reports: dict[str, tuple[int, int, int]] = field(default_factory=dict)

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

    async def step(self, *, forward: bool = True, **kw: Any) -> pb.StepResponse:
        """One Step carrying the pending reports; with `forward`, every PoolStep it returns is
        taken as run by its node (reported complete with the next step)."""
        if "reports" not in kw:
            kw["reports"] = dict(self.reports)
        resp = await self.stub.Step(step_request(**kw))
        for pool in kw["reports"]:
            self.reports.pop(pool, None)
        if forward:
            for ps in resp.steps:
                done = self.reports.get(ps.pool_id, (ps.epoch, 0, 0))[1]
                self.reports[ps.pool_id] = (ps.epoch, max(done, ps.step_id), 0)
        return resp

    async def allocate(
        self, seq_id: str, pool: str = "n1", tokens: list[int] | None = None, num_tokens: int = 0,
        salt: str | None = None, num_compute: int = 0, **kw: Any,
    ) -> pb.StepResponse:
        return await self.step(allocs=[(seq_id, pool, tokens, num_tokens, salt, num_compute)], **kw)

    async def append(self, *items: tuple[str, int], **kw: Any) -> pb.StepResponse:
        return await self.step(appends=list(items), **kw)

    async def free(self, *seq_ids: str, **kw: Any) -> pb.StepResponse:
        return await self.step(frees=list(seq_ids), **kw)

    async def fork(self, parent: str, *children: str, **kw: Any) -> pb.StepResponse:
        return await self.step(forks=[(parent, list(children))], **kw)

    async def flush(self) -> pb.StepResponse:
        """A Step with nothing but the pending reports."""
        return await self.step()

    async def fsck(self) -> list[str]:
        return list((await self.admin.Fsck(pb.FsckRequest())).problems)

    def state_snapshot(self) -> dict:
        assert self.server.runtime is not None
        return self.server.runtime.state.to_snapshot()

    def table(self, seq_id: str) -> tuple[int, ...]:
        assert self.server.runtime is not None
        return self.server.runtime.state.core.get_sequence(seq_id).block_table  # type: ignore[arg-type]


async def expect_code(coro: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, f"expected {code.name}, got {info.value.code().name}: {info.value.details()}"
    return info.value


