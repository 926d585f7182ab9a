"""Synchronous data-plane client (`grpc` channel).

Every method is one logical call: mutating ones generate a request id once and resend it
verbatim on retry (UNAVAILABLE / DEADLINE_EXCEEDED only, bounded exponential backoff with
jitter), so a retry of a call the server already applied returns the recorded result.
Each attempt gets the full per-call deadline (`timeout_s`). Errors come back as the typed
exceptions of `block_manager.client.errors`; results as core / client dataclasses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from block_manager.client import wire
from block_manager.client.base import CHANNEL_OPTIONS, DEFAULT_TIMEOUT_S, ClientBase
from block_manager.client.errors import error_from_rpc
from block_manager.client.retry import RetryPolicy, request_id_or_new
from block_manager.client.step import StepBatch, StepResult, run_sync
from block_manager.client.types import (
    AllocateSpec,
    HeartbeatResult,
    ItemFailure,
    NodeRegistration,
    PoolRoute,
    TablesUpdate,
)
from block_manager.core.types import AllocateResult, AppendRequest, AppendResult, DefragPlan, SeqId, SequenceView
from pagedkv.rpc import call_with_retry
from pagedkv.v1 import block_manager_pb2 as pb


class BlockManagerClient(ClientBase):
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        channel: grpc.Channel | None = None,
        block_sizes: Mapping[str, int] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(target, channel, grpc.insecure_channel, timeout_s=timeout_s, retry=retry,
                         block_sizes=block_sizes, seed=seed)

    def close(self) -> None:
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> BlockManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, timeout_s: float | None) -> Any:
        fn = getattr(self._stub, method)
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            return call_with_retry(
                lambda: fn(request, timeout=timeout), self.retry, self._rng,
                lambda retry: self.stats.record_attempt(method, retry),
            )
        except grpc.RpcError as exc:
            self.stats.errors += 1
            raise error_from_rpc(exc, method) from exc

    # ---- nodes ----------------------------------------------------------------------
    def register_node(
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
        reg = wire.registration(self._call("RegisterNode", req, timeout_s))
        self.tracker.set_block_size(reg.pool_id, reg.block_size)
        return reg

    def heartbeat(self, node_id: str, epoch: int, *, timeout_s: float | None = None) -> HeartbeatResult:
        return wire.heartbeat(self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, epoch=epoch), timeout_s))

    # ---- sequences ------------------------------------------------------------------
    def allocate(
        self,
        items: Sequence[AllocateSpec],
        *,
        pool_epochs: Mapping[str, int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[AllocateResult | ItemFailure]:
        req = wire.allocate_request(request_id_or_new(request_id), items, pool_epochs)
        return wire.allocate_outcomes(self._call("Allocate", req, timeout_s), items)

    def allocate_one(
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
        (out,) = self.allocate([spec])
        if isinstance(out, ItemFailure):
            raise out.error
        return out

    def append_slots(
        self,
        requests: Sequence[AppendRequest],
        *,
        pool_epochs: Mapping[str, int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[AppendResult | ItemFailure]:
        req = wire.append_request(request_id_or_new(request_id), requests, pool_epochs)
        return wire.append_outcomes(self._call("AppendSlots", req, timeout_s), requests)

    def fork(
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
        return [wire.sequence_view(t) for t in self._call("Fork", req, timeout_s).children]

    def free(
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
        return int(self._call("Free", req, timeout_s).num_freed)

    # ---- node-side ------------------------------------------------------------------
    def get_tables(
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
        return wire.tables_update(self._call("GetTables", req, timeout_s))

    def ack_copy_ops(
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
        return [int(p) for p in self._call("AckCopyOps", req, timeout_s).committed_plan_ids]

    # ---- defrag and routing ---------------------------------------------------------
    def plan_defrag(
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
        resp = self._call("PlanDefrag", req, timeout_s)
        return wire.defrag_plan(resp.plan) if resp.HasField("plan") else None

    def commit_defrag(
        self, plan_id: int, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> list[SeqId]:
        req = pb.CommitDefragRequest(request_id=request_id_or_new(request_id), plan_id=plan_id)
        return [SeqId(s) for s in self._call("CommitDefrag", req, timeout_s).updated_seq_ids]

    def abort_defrag(self, plan_id: int, *, request_id: str | None = None, timeout_s: float | None = None) -> None:
        self._call(
            "AbortDefrag", pb.AbortDefragRequest(request_id=request_id_or_new(request_id), plan_id=plan_id), timeout_s
        )

    def route(
        self, token_ids: Sequence[int], *, salt: str | None = None, timeout_s: float | None = None
    ) -> list[PoolRoute]:
        req = pb.RouteRequest(token_ids=list(token_ids))
        if salt is not None:
            req.salt = salt
        return wire.routes(self._call("Route", req, timeout_s))

    # ---- scheduler steps ------------------------------------------------------------
    def step(self, *, pool_epochs: Mapping[str, int] | None = None) -> SyncStep:
        """A batch for one scheduler step; `commit()` sends it (see `client.step`)."""
        return SyncStep(self, self.tracker, pool_epochs)


class SyncStep(StepBatch):
    def commit(self) -> StepResult:
        return run_sync(self)


__all__ = ["CHANNEL_OPTIONS", "DEFAULT_TIMEOUT_S", "BlockManagerClient", "SyncStep"]
