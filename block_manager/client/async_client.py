"""Asyncio data-plane client (`grpc.aio` channel): the same calls, retries, request ids,
typed errors and step helper as `BlockManagerClient`, awaited.

Create it inside the event loop that uses it (a `grpc.aio` channel is bound to its loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from block_manager.client import wire
from block_manager.client.base import DEFAULT_TIMEOUT_S, ClientBase
from block_manager.client.errors import error_from_rpc
from block_manager.client.retry import RetryPolicy, request_id_or_new
from block_manager.client.step import StepBatch, StepResult, run_async
from block_manager.client.types import (
    AllocateSpec,
    HeartbeatResult,
    ItemFailure,
    NodeRegistration,
    PoolRoute,
    TablesUpdate,
)
from block_manager.core.types import AllocateResult, AppendRequest, AppendResult, DefragPlan, SeqId, SequenceView
from pagedkv.rpc import acall_with_retry
from pagedkv.v1 import block_manager_pb2 as pb


class AsyncBlockManagerClient(ClientBase):
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        channel: grpc.aio.Channel | None = None,
        block_sizes: Mapping[str, int] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(target, channel, grpc.aio.insecure_channel, timeout_s=timeout_s, retry=retry,
                         block_sizes=block_sizes, seed=seed)

    async def close(self) -> None:
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncBlockManagerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, timeout_s: float | None) -> Any:
        fn = getattr(self._stub, method)
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            return await acall_with_retry(
                lambda: fn(request, timeout=timeout), self.retry, self._rng,
                lambda retry: self.stats.record_attempt(method, retry),
            )
        except grpc.RpcError as exc:
            self.stats.errors += 1
            raise error_from_rpc(exc, method) from exc

    # ---- nodes ----------------------------------------------------------------------
    async def register_node(
        self,
        node_id: str,
        num_blocks: int,
        *,
        block_size: int = 0,
        geometry: Mapping[str, Any] | None = None,
        address: str = "",
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> NodeRegistration:
        req = wire.register_node_request(
            request_id_or_new(request_id), node_id, num_blocks, block_size, geometry, address
        )
        reg = wire.registration(await self._call("RegisterNode", req, timeout_s))
        self.tracker.set_block_size(reg.pool_id, reg.block_size)
        return reg

    async def heartbeat(self, node_id: str, epoch: int, *, timeout_s: float | None = None) -> HeartbeatResult:
        return wire.heartbeat(
            await self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, epoch=epoch), timeout_s)
        )

    # ---- sequences ------------------------------------------------------------------
    async def allocate(
        self,
        items: Sequence[AllocateSpec],
        *,
        pool_epochs: Mapping[str, int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[AllocateResult | ItemFailure]:
        req = wire.allocate_request(request_id_or_new(request_id), items, pool_epochs)
        return wire.allocate_outcomes((await self._call("Allocate", req, timeout_s)), items)

    async def allocate_one(
        self,
        seq_id: str,
        pool_id: str,
        token_ids: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: str | None = None,
    ) -> AllocateResult:
        """Admit one sequence; raises the item's typed error on failure."""
        spec = AllocateSpec(
            SeqId(seq_id), pool_id, tuple(token_ids) if token_ids is not None else None, num_tokens, salt
        )  # type: ignore[arg-type]
        (out,) = await self.allocate([spec])
        if isinstance(out, ItemFailure):
            raise out.error
        return out

    async def append_slots(
        self,
        requests: Sequence[AppendRequest],
        *,
        pool_epochs: Mapping[str, int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[AppendResult | ItemFailure]:
        req = wire.append_request(request_id_or_new(request_id), requests, pool_epochs)
        return wire.append_outcomes((await self._call("AppendSlots", req, timeout_s)), requests)

    async def fork(
        self,
        parent: str,
        child_ids: Sequence[str],
        *,
        pool_epochs: Mapping[str, int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[SequenceView]:
        req = pb.ForkRequest(
            request_id=request_id_or_new(request_id),
            parent_seq_id=parent,
            child_seq_ids=list(child_ids),
            pool_epochs=dict(pool_epochs or {}),
        )
        return [wire.sequence_view(t) for t in (await self._call("Fork", req, timeout_s)).children]

    async def free(
        self,
        seq_ids: Sequence[str],
        *,
        pool_epochs: Mapping[str, int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> int:
        req = pb.FreeRequest(
            request_id=request_id_or_new(request_id), seq_ids=list(seq_ids), pool_epochs=dict(pool_epochs or {})
        )
        return int((await self._call("Free", req, timeout_s)).num_freed)

    # ---- node-side ------------------------------------------------------------------
    async def get_tables(
        self,
        node_id: str,
        epoch: int,
        seq_ids: Sequence[str],
        known_versions: Mapping[str, int] | None = None,
        *,
        after_op_id: int = 0,
        timeout_s: float | None = None,
    ) -> TablesUpdate:
        req = pb.GetTablesRequest(
            node_id=node_id,
            epoch=epoch,
            seq_ids=list(seq_ids),
            known_versions=dict(known_versions or {}),
            after_op_id=after_op_id,
        )
        return wire.tables_update(await self._call("GetTables", req, timeout_s))

    async def ack_copy_ops(
        self,
        node_id: str,
        epoch: int,
        up_to_op_id: int,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[int]:
        req = pb.AckCopyOpsRequest(
            request_id=request_id_or_new(request_id), node_id=node_id, epoch=epoch, up_to_op_id=up_to_op_id
        )
        return [int(p) for p in (await self._call("AckCopyOps", req, timeout_s)).committed_plan_ids]

    # ---- defrag and routing ---------------------------------------------------------
    async def plan_defrag(
        self,
        pool_id: str,
        kind: str = "compaction",
        *,
        max_moves: int = 0,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> DefragPlan | None:
        req = pb.PlanDefragRequest(
            request_id=request_id_or_new(request_id), pool_id=pool_id, kind=kind, max_moves=max_moves
        )
        resp = await self._call("PlanDefrag", req, timeout_s)
        return wire.defrag_plan(resp.plan) if resp.HasField("plan") else None

    async def commit_defrag(
        self, plan_id: int, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> list[SeqId]:
        req = pb.CommitDefragRequest(request_id=request_id_or_new(request_id), plan_id=plan_id)
        return [SeqId(s) for s in (await self._call("CommitDefrag", req, timeout_s)).updated_seq_ids]

    async def abort_defrag(
        self, plan_id: int, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> None:
        await self._call(
            "AbortDefrag", pb.AbortDefragRequest(request_id=request_id_or_new(request_id), plan_id=plan_id), timeout_s
        )

    async def route(
        self, token_ids: Sequence[int], *, salt: str | None = None, timeout_s: float | None = None
    ) -> list[PoolRoute]:
        req = pb.RouteRequest(token_ids=list(token_ids))
        if salt is not None:
            req.salt = salt
        return wire.routes(await self._call("Route", req, timeout_s))

    # ---- scheduler steps ------------------------------------------------------------
    def step(self, *, pool_epochs: Mapping[str, int] | None = None) -> AsyncStep:
        """A batch for one scheduler step; `await commit()` sends it."""
        return AsyncStep(self, self.tracker, pool_epochs)


class AsyncStep(StepBatch):
    async def commit(self) -> StepResult:
        return await run_async(self)


__all__ = ["AsyncBlockManagerClient", "AsyncStep"]
