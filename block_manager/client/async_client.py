"""Asyncio data-plane client (`grpc.aio` channel): the same calls, retries, request ids,
typed errors and step helper as `BlockManagerClient`, awaited.

Create it inside the event loop that uses it (a `grpc.aio` channel is bound to its loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from block_manager.client.base import DEFAULT_TIMEOUT_S, ClientBase, Operation, T
from block_manager.client.errors import BlockManagerError, FailedPreconditionError, UnavailableError, error_from_rpc
from block_manager.client.retry import RetryPolicy
from block_manager.client.step import StepBatch, StepResult
from block_manager.client.types import FleetAssignment, HeartbeatResult, NodeRegistration, PoolRoute, TablesUpdate
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
        pipeline_steps: bool = False,
    ) -> None:
        """Connect to `target` (host:port); `scheduler_id` defaults to a fresh unique name; `tls`
        and `token`: see `ClientBase` (plaintext without credentials when neither is given);
        `sessions`: see `ClientBase`. `pipeline_steps`: a step may be committed while earlier
        ones are still in flight (`commit`; needs sessions)."""
        super().__init__(
            target, channel, True, timeout_s=timeout_s, retry=retry, block_sizes=block_sizes,
            seed=seed, scheduler_id=scheduler_id, tls=tls, token=token, sessions=sessions,
            failover_s=failover_s,
        )
        self.session.pipelined = pipeline_steps
        self._last_commit: asyncio.Future[None] | None = None   # the newest pipelined commit's apply

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

    async def _run(self, op: Operation[T]) -> T:
        """Run one operation of the client core (`ClientBase`): each call it yields is sent
        (with retries) and its reply sent back in, or its `BlockManagerError` thrown in."""
        try:
            call = next(op)
            while True:
                try:
                    reply = await self._call(call.method, call.request, call.timeout_s)
                except BlockManagerError as exc:
                    call = op.throw(exc)
                else:
                    call = op.send(reply)
        except StopIteration as done:
            result: T = done.value   # what the operation returned
            return result

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
        return await self._run(self._register_op(
            node_id, num_blocks, block_size, geometry, address, host_num_blocks, disk_num_blocks, disk_blocks,
            request_id, timeout_s))

    async def heartbeat(self, node_id: str, epoch: int, *, timeout_s: float | None = None) -> HeartbeatResult:
        """Renew the lease of `(node_id, epoch)`."""
        return await self._run(self._heartbeat_op(node_id, epoch, timeout_s))

    # ---- fleet mode -----------------------------------------------------------------
    async def scheduler_heartbeat(
        self,
        *,
        address: str = "",
        pin_pool_ids: Sequence[str] = (),
        num_running: int = 0,
        num_waiting: int = 0,
        released_pool_ids: Sequence[str] = (),
        leave: bool = False,
        timeout_s: float | None = None,
    ) -> FleetAssignment:
        """Join the fleet as `scheduler_id` or renew the membership (every `ttl_s / 3`): the
        pools this scheduler owns now (step on those only), those it is asked to hand over,
        and the TTL. `address`: its API base URL for routers ("" = not routable);
        `pin_pool_ids`: own only these pools; `released_pool_ids`: pools it was asked to
        release and now holds nothing on; `leave`: release everything and leave the fleet."""
        return await self._run(self._scheduler_heartbeat_op(
            address, pin_pool_ids, num_running, num_waiting, released_pool_ids, leave, timeout_s))

    async def deliver_grants(self, *, timeout_s: float | None = None) -> StepResult:
        """Send a Step even with nothing in it (plus pending reports): a fleet member whose
        heartbeat named `lending_pool_ids` gets those pools' PoolSteps (serve grants for another
        scheduler's prefix fetch) to pass to their nodes, like any step's."""
        return await self._run(self._deliver_grants_op(self.step(), timeout_s))

    # ---- the scheduler step ---------------------------------------------------------
    def step(self, *, pool_epochs: Mapping[str, int] | None = None) -> AsyncStep:
        """A new scheduler step; fill it and `await commit()` it."""
        return AsyncStep(self, pool_epochs)

    async def flush_reports(self, *, timeout_s: float | None = None) -> StepResult | None:
        """Send pending Forward reports now (an idle scheduler: plans whose moves ran commit)."""
        return await self._run(self._flush_op(self.step(), timeout_s))

    async def release(self, *, timeout_s: float | None = None) -> None:
        """Give up this scheduler's pool leases (after freeing its sequences: any left are
        dropped), so another scheduler can drive the pools at once."""
        await self._run(self._release_op(self.step(), timeout_s))

    async def free(self, seq_ids: Sequence[str], *, timeout_s: float | None = None) -> int:
        """Free sequences in a step of their own (all or nothing)."""
        return await self._run(self._free_op(self.step(), seq_ids, timeout_s))

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
        return await self._run(self._tables_op(node_id, epoch, seq_ids, known_versions, timeout_s))

    async def route(
        self, token_ids: Sequence[int], *, salt: str | None = None, timeout_s: float | None = None
    ) -> list[PoolRoute]:
        """Pools ranked for one prompt: longest cached prefix, then most free blocks."""
        return await self._run(self._route_op(token_ids, salt, timeout_s))

    async def route_many(
        self, prompts: Sequence[tuple[Sequence[int], str | None]], *, timeout_s: float | None = None
    ) -> list[list[PoolRoute]]:
        """`route` for several `(token_ids, salt)` prompts in one call."""
        return await self._run(self._route_many_op(prompts, timeout_s))

    # ---- the step, public for the step helper ---------------------------------------
    async def commit(
        self, batch: StepBatch, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> StepResult:
        """Send `batch` (at most one RPC) and return what every item got (`step.commit()`).

        With `pipeline_steps`, commits may overlap: each is sent at once, stamped after the one
        before it (the server applies them in the order they were committed and refuses one
        whose predecessor failed), and its answer is applied only after the one before it was
        (answers may arrive in any order). When the one before failed, this one raises
        `FailedPreconditionError` too and keeps its request for `resend` (its outcome on the
        server is the server's to say: resend the one before first). A batch committed before
        an earlier one's answer is in must only touch sequences the client already holds."""
        if not self.session.pipelined:
            return await self._run(self._commit_op(batch, request_id, timeout_s))
        before, mine = self._last_commit, asyncio.get_running_loop().create_future()
        self._last_commit = mine
        try:
            sent = await self._run(self._send_op(batch, request_id, timeout_s))
            if before is not None and sent is not None:   # nothing sent: nothing waits on it
                await self._predecessor_applied(before, batch, sent)
            result = batch.result if sent is None else self._apply_reply(batch, *sent)
        except BaseException as exc:   # the next commit fails with its own error (cancelled: an unknown outcome)
            mine.set_exception(exc if isinstance(exc, Exception) else UnavailableError(f"commit cancelled: {exc!r}"))
            mine.exception()   # retrieved
            raise
        mine.set_result(None)
        return result

    @staticmethod
    async def _predecessor_applied(
        before: asyncio.Future[None], batch: StepBatch, sent: tuple[pb.StepRequest, pb.StepResponse],
    ) -> None:
        try:
            await asyncio.shield(before)
        except Exception as exc:   # noqa: BLE001 - any failure of the one before fails this one
            batch.distrust(sent[0])
            raise FailedPreconditionError(
                f"the step committed before this one failed ({exc}); resend that one, then this one",
                reason="PredecessorFailed", method="Step",
            ) from exc

    async def resend(self, batch: StepBatch, *, timeout_s: float | None = None) -> StepResult:
        """Send the request of `batch`'s failed commit again (`step.resend()`)."""
        return await self._run(self._resend_op(batch, timeout_s))


class AsyncStep(StepBatch):
    """A step of `AsyncBlockManagerClient`: fill it, then `await commit()` it."""

    _client: AsyncBlockManagerClient

    async def commit(self, *, request_id: str | None = None, timeout_s: float | None = None) -> StepResult:
        """Send the step (at most one RPC) and return what every item got."""
        return await self._client.commit(self, request_id=request_id, timeout_s=timeout_s)

    async def resend(self, *, timeout_s: float | None = None) -> StepResult:
        """Send a step whose `commit` failed again, same request id: the block manager applies a
        request id at most once and answers a repeat from its journal, also across its restarts,
        so a scheduler can ride out an unreachable block manager (UNAVAILABLE, DEADLINE_EXCEEDED)
        without losing or doubling the step. Raises like `commit`."""
        return await self._client.resend(self, timeout_s=timeout_s)

__all__ = ["AsyncBlockManagerClient", "AsyncStep"]
