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
from block_manager.client.errors import BlockManagerError, error_from_rpc
from block_manager.client.retry import RetryPolicy, new_request_id, request_id_or_new
from block_manager.client.step import StepBatch, StepResult
from block_manager.client.types import HeartbeatResult, NodeRegistration, PoolRoute, TablesUpdate
from pagedkv.endpoints import DEFAULT_FAILOVER_S
from pagedkv.rpc import acall_with_retry
from pagedkv.tls import TlsSettings
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
        scheduler_id: str | None = None,
        tls: TlsSettings | None = None,
        token: str | None = None,
        sessions: bool = True,
        failover_s: float = DEFAULT_FAILOVER_S,
    ) -> None:
        """Connect to `target` (host:port); `scheduler_id` defaults to a fresh unique name; `tls`
        and `token`: see `ClientBase` (plaintext without credentials when neither is given);
        `sessions`: see `ClientBase`."""
        super().__init__(
            target, channel, True, timeout_s=timeout_s, retry=retry, block_sizes=block_sizes,
            seed=seed, scheduler_id=scheduler_id, tls=tls, token=token, sessions=sessions,
            failover_s=failover_s,
        )

    async def close(self) -> None:
        """Close the channel (if this client created it)."""
        for channel in self._owned_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncBlockManagerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            return await acall_with_retry(
                lambda: getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata),
                self._retry_policy(), self._rng, lambda retry: self._on_attempt(method, retry),
            )
        except grpc.RpcError as exc:
            self.stats.errors += 1
            raise error_from_rpc(exc, method) from exc

    async def _mutating_call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """`_call` inside this client's session (opened on first use; see `ClientBase`)."""
        if self.session.needs_open():
            try:
                self.session.adopt(await self._call("OpenSession", self._open_session_request(), timeout_s))
            except BlockManagerError as exc:
                self._session_failed(exc)
        self.session.stamp(request)
        try:
            reply = await self._call(method, request, timeout_s)
        except BlockManagerError as exc:
            self._after_mutating(request, exc)
            raise
        self._after_mutating(request, None)
        return reply

    # ---- nodes ----------------------------------------------------------------------
    async def register_node(
        self,
        node_id: str,
        num_blocks: int,
        *,
        block_size: int = 0,
        geometry: Mapping[str, Any] | None = None,
        address: str = "",
        host_num_blocks: int = 0,
        disk_num_blocks: int = 0,
        disk_blocks: Sequence[Any] = (),
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> NodeRegistration:
        """Register a pool (a new epoch; any previous epoch of the node is fenced)."""
        req = wire.register_node_request(
            request_id_or_new(request_id), node_id, num_blocks, block_size, geometry, address, host_num_blocks,
            disk_num_blocks, disk_blocks,
        )
        reg = wire.registration(await self._mutating_call("RegisterNode", req, timeout_s))
        self.tracker.set_block_size(reg.pool_id, reg.block_size)
        return reg

    async def heartbeat(self, node_id: str, epoch: int, *, timeout_s: float | None = None) -> HeartbeatResult:
        """Renew the lease of `(node_id, epoch)`."""
        reply = await self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, epoch=epoch), timeout_s)
        return wire.heartbeat(reply)

    # ---- the scheduler step ---------------------------------------------------------
    def step(self, *, pool_epochs: Mapping[str, int] | None = None) -> AsyncStep:
        """A new scheduler step; fill it and `await commit()` it."""
        return AsyncStep(self, pool_epochs)

    async def flush_reports(self, *, timeout_s: float | None = None) -> StepResult | None:
        """Send pending Forward reports now (an idle scheduler: plans whose moves ran commit)."""
        if not self._reports:
            return None
        step = self.step()
        step.flush = True
        return await step.commit(timeout_s=timeout_s)

    async def release(self, *, timeout_s: float | None = None) -> None:
        """Give up this scheduler's pool leases (after freeing its sequences: any left are
        dropped), so another scheduler can drive the pools at once."""
        step = self.step()
        step.release = True
        await step.commit(timeout_s=timeout_s)
        self.held_pools.clear()

    async def free(self, seq_ids: Sequence[str], *, timeout_s: float | None = None) -> int:
        """Free sequences in a step of their own (all or nothing)."""
        step = self.step()
        step.free(seq_ids)
        return (await step.commit(timeout_s=timeout_s)).num_freed

    # ---- cold tables and routing ----------------------------------------------------
    async def get_tables(
        self,
        node_id: str,
        epoch: int,
        seq_ids: Sequence[str],
        known_versions: Mapping[str, int] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> TablesUpdate:
        """A node's cold cache: the tables newer than `known_versions`."""
        req = pb.GetTablesRequest(
            node_id=node_id, epoch=epoch, seq_ids=list(seq_ids), known_versions=dict(known_versions or {})
        )
        return wire.tables_update(await self._call("GetTables", req, timeout_s))

    async def route(
        self, token_ids: Sequence[int], *, salt: str | None = None, timeout_s: float | None = None
    ) -> list[PoolRoute]:
        """Pools ranked for one prompt: longest cached prefix, then most free blocks."""
        return wire.routes(await self._call("Route", self._route_request(token_ids, salt), timeout_s))

    async def route_many(
        self, prompts: Sequence[tuple[Sequence[int], str | None]], *, timeout_s: float | None = None
    ) -> list[list[PoolRoute]]:
        """`route` for several `(token_ids, salt)` prompts in one call."""
        return self._route_many(await self._call("Route", wire.route_request(prompts), timeout_s))


class AsyncStep(StepBatch):
    async def commit(self, *, request_id: str | None = None, timeout_s: float | None = None) -> StepResult:
        """Send the step (at most one RPC) and return what every item got."""
        client: AsyncBlockManagerClient = self._client
        request = client._begin(self, request_id or new_request_id())
        if request is None:
            return self.result
        try:
            reply = await client._mutating_call("Step", request, timeout_s)
        except BlockManagerError:
            self.distrust(request)
            raise
        client._sent(request, reply)
        return self.apply(reply)

    async def resend(self, *, timeout_s: float | None = None) -> StepResult:
        """Send a step whose `commit` failed again, same request id: the block manager applies a
        request id at most once and answers a repeat from its journal, also across its restarts,
        so a scheduler can ride out an unreachable block manager (UNAVAILABLE, DEADLINE_EXCEEDED)
        without losing or doubling the step. Raises like `commit`."""
        client = self._client
        request = self.unanswered()
        reply = await client._mutating_call("Step", request, timeout_s)
        self._unanswered = None
        client._sent(request, reply)
        return self.apply(reply)


__all__ = ["AsyncBlockManagerClient", "AsyncStep"]
