"""Data-plane servicer: protobuf ↔ JSON-shaped payload/result dicts, no logic.

Each mutating RPC becomes `runtime.mutate(op, request_id, digest, payload)`; the digest
is a sha256 of the deterministic protobuf encoding of the request with its `request_id`
cleared (plus the method name), which is what a retry is compared against. Errors are not
handled here: they propagate to `ErrorMappingInterceptor`.
"""

from __future__ import annotations

import grpc

from block_manager.core.errors import InvalidRequest
from block_manager.core.types import PoolId, SeqId
from block_manager.service.defrag_runner import DefragRunner
from block_manager.service.protocol import (
    MutatingServicer,
    defrag_kind,
    item_error_pb,
    plan_pb,
    table_pb,
)
from block_manager.service.runtime import ServiceRuntime
from block_manager.service.state_codec import ItemFailureRecord, check_count, check_id, check_ids, decode_append_outcome
from block_manager.service.status import code_for_reason
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


class BlockManagerServicer(MutatingServicer, pb_grpc.BlockManagerServicer):
    def __init__(self, runtime: ServiceRuntime, defrag: DefragRunner) -> None:
        super().__init__(runtime)
        self.defrag = defrag

    # ---- nodes ----------------------------------------------------------------------
    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNodeResponse:
        g = request.geometry
        payload = {
            "node_id": request.node_id,
            "num_blocks": request.num_blocks,
            "block_size": request.block_size,
            "geometry": {
                "num_layers": g.num_layers,
                "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
                "dtype": g.dtype,
                "device": g.device,
            },
            "address": request.address,
        }
        r = await self._mutate("RegisterNode", request, "register_node", payload)
        return pb.RegisterNodeResponse(
            pool_id=r["pool_id"],
            epoch=r["epoch"],
            lease_ttl_s=r["lease_ttl_s"],
            block_size=r["block_size"],
            num_blocks=r["num_blocks"],
            prefetch_window=r["prefetch_window"],
        )

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        ttl = self.runtime.heartbeat(request.node_id, request.epoch)
        node = self.runtime.state.registry.get(request.node_id)
        pending = self.runtime.state.core.pending_copy_ops(PoolId(request.node_id))
        return pb.HeartbeatResponse(
            lease_ttl_s=ttl, draining=node.draining, last_pending_op_id=pending[-1].op_id if pending else 0
        )

    # ---- sequences ------------------------------------------------------------------
    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        items = [
            {
                "seq_id": it.seq_id,
                "pool_id": it.pool_id,
                "token_ids": list(it.token_ids) if it.token_ids else None,
                "num_tokens": it.num_tokens or None,
                "salt": it.salt if it.HasField("salt") else None,
            }
            for it in request.items
        ]
        payload = {"items": items, "pool_epochs": dict(request.pool_epochs)}
        r = await self._mutate("Allocate", request, "allocate", payload)
        outcomes = []
        for o in r["outcomes"]:
            if "error" in o:
                outcomes.append(pb.AllocateOutcome(error=item_error_pb(o["error"])))
            else:
                a = o["allocation"]
                outcomes.append(
                    pb.AllocateOutcome(
                        allocation=pb.SequenceAllocation(
                            seq_id=a["seq_id"],
                            pool_id=a["pool_id"],
                            block_table=a["block_table"],
                            num_cached_tokens=a["num_cached_tokens"],
                            slot_mapping=a["slot_mapping"],
                            version=a["version"],
                        )
                    )
                )
        return pb.AllocateResponse(outcomes=outcomes)

    async def AppendSlots(
        self, request: pb.AppendSlotsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AppendSlotsResponse:
        items = [[it.seq_id, it.num_new_tokens, list(it.token_ids) if it.token_ids else None] for it in request.items]
        payload = {"items": items, "pool_epochs": dict(request.pool_epochs)}
        r = await self._mutate("AppendSlots", request, "append_slots", payload)
        # Filled in place (outcomes.add()): several times faster than building nested
        # messages from keyword arguments, and this is the per-step hot path.
        resp = pb.AppendSlotsResponse()
        add = resp.outcomes.add
        for o in map(decode_append_outcome, r["outcomes"]):
            if isinstance(o, ItemFailureRecord):
                e = add().error
                e.code, e.reason, e.message = code_for_reason(o.reason).value[0], o.reason, o.message
                continue
            a = add().appended
            a.seq_id = o.seq_id
            a.slot_mapping.extend(o.slot_mapping)
            if o.new_block_ids:
                a.new_block_ids.extend(o.new_block_ids)
            for op in o.copy_ops:
                c = a.copy_ops.add()
                c.op_id, c.src, c.dst, c.kind = op
            a.version = o.version
            a.num_tokens = o.num_tokens
        return resp

    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext) -> pb.ForkResponse:
        check_id("parent_seq_id", request.parent_seq_id)
        payload = {
            "parent": request.parent_seq_id,
            "children": list(request.child_seq_ids),
            "pool_epochs": dict(request.pool_epochs),
        }
        r = await self._mutate("Fork", request, "fork", payload)
        return pb.ForkResponse(children=[table_pb(t) for t in r["children"]])

    async def Free(self, request: pb.FreeRequest, context: grpc.aio.ServicerContext) -> pb.FreeResponse:
        payload = {"seq_ids": list(request.seq_ids), "pool_epochs": dict(request.pool_epochs)}
        r = await self._mutate("Free", request, "free", payload)
        return pb.FreeResponse(num_freed=r["num_freed"])

    # ---- tables and copy ops --------------------------------------------------------
    async def GetTables(self, request: pb.GetTablesRequest, context: grpc.aio.ServicerContext) -> pb.GetTablesResponse:
        self.runtime.check_readable()
        state = self.runtime.state
        node = state.registry.check_epoch(request.node_id, request.epoch)
        seq_ids = [SeqId(s) for s in request.seq_ids]
        check_count("number of seq_ids", len(seq_ids), 0, state.config.max_batch)
        check_ids("seq_id", seq_ids)
        known = {SeqId(k): v for k, v in request.known_versions.items()}
        views = state.core.get_tables(seq_ids, known)
        for v in views:
            if v.pool_id != node.node_id:
                raise InvalidRequest(f"sequence {v.seq_id!r} is on pool {v.pool_id!r}, not {node.node_id!r}")
        ops = state.core.pending_copy_ops(node.node_id, request.after_op_id)
        return pb.GetTablesResponse(
            tables=[
                pb.SequenceTable(
                    seq_id=v.seq_id,
                    pool_id=v.pool_id,
                    block_table=v.block_table,
                    num_tokens=v.num_tokens,
                    version=v.version,
                )
                for v in views
            ],
            copy_ops=[pb.CopyOp(op_id=op.op_id, src=op.src, dst=op.dst, kind=op.kind) for op in ops],
        )

    async def AckCopyOps(
        self, request: pb.AckCopyOpsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckCopyOpsResponse:
        payload = {"node_id": request.node_id, "epoch": request.epoch, "up_to_op_id": request.up_to_op_id}
        r = await self._mutate("AckCopyOps", request, "ack_copy_ops", payload)
        return pb.AckCopyOpsResponse(committed_plan_ids=r["committed_plan_ids"])

    # ---- defrag ---------------------------------------------------------------------
    async def PlanDefrag(
        self, request: pb.PlanDefragRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlanDefragResponse:
        payload = {
            "pool_id": request.pool_id,
            "kind": defrag_kind(request.kind),
            "max_moves": request.max_moves or None,
        }
        r = await self._mutate("PlanDefrag", request, "plan_defrag", payload)
        plan = r["plan"]
        return pb.PlanDefragResponse(plan=plan_pb(plan)) if plan else pb.PlanDefragResponse()

    async def CommitDefrag(
        self, request: pb.CommitDefragRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitDefragResponse:
        r = await self._mutate("CommitDefrag", request, "commit_defrag", {"plan_id": request.plan_id})
        return pb.CommitDefragResponse(updated_seq_ids=r["updated_seq_ids"])

    async def AbortDefrag(
        self, request: pb.AbortDefragRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortDefragResponse:
        await self._mutate("AbortDefrag", request, "abort_defrag", {"plan_id": request.plan_id})
        return pb.AbortDefragResponse()

    # ---- routing --------------------------------------------------------------------
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        self.runtime.check_readable()
        state = self.runtime.state
        entries = state.core.route(list(request.token_ids), request.salt if request.HasField("salt") else None)
        out = []
        for e in entries:
            node = state.registry.get(e.pool_id)
            if node.draining or node.fenced:
                continue
            out.append(
                pb.RouteEntry(
                    pool_id=e.pool_id,
                    num_cached_tokens=e.num_cached_tokens,
                    num_free_blocks=e.num_free_blocks,
                    address=node.address,
                )
            )
        return pb.RouteResponse(entries=out)


__all__ = ["BlockManagerServicer"]
