"""Admin-plane servicer (`BlockManagerAdmin`): status, listings, drain, fsck, cache reset,
defrag trigger. Like the data plane it only translates; errors go to the interceptor."""

from __future__ import annotations

import grpc

from block_manager.core.types import DiskTierMetrics, HostTierMetrics, PoolId, SeqId
from block_manager.service.defrag_runner import DefragRunner
from block_manager.service.protocol import (
    MutatingServicer,
    check_request_id,
    defrag_kind,
    plan_pb,
    request_digest,
    session_of,
)
from block_manager.service.runtime import ServiceRuntime
from block_manager.service.state_codec import check_id, check_optional_str
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

MAX_LIST = 10_000


def host_status(h: HostTierMetrics | None) -> dict[str, int]:
    """The host tier fields of a PoolStatus (none for a pool without a host tier)."""
    if h is None:
        return {}
    return {
        "host_num_blocks": h.num_blocks, "host_free_blocks": h.num_free_blocks,
        "host_cached_blocks": h.num_cached_blocks, "host_used_blocks": h.num_used_blocks,
        "num_swapped_sequences": h.num_swapped_sequences, "swapped_out_blocks": h.swapped_out_blocks,
        "swapped_in_blocks": h.swapped_in_blocks, "offloaded_blocks": h.offloaded_blocks,
        "onboarded_blocks": h.onboarded_blocks, "host_hit_tokens": h.host_hit_tokens,
    }


def disk_status(d: DiskTierMetrics | None) -> dict[str, int]:
    """The disk tier fields of a PoolStatus (none for a pool without a disk tier)."""
    if d is None:
        return {}
    return {
        "disk_num_blocks": d.num_blocks, "disk_cached_blocks": d.num_cached_blocks,
        "disk_offloaded_blocks": d.disk_offloaded_blocks, "disk_onboarded_blocks": d.disk_onboarded_blocks,
        "disk_hit_tokens": d.disk_hit_tokens,
    }


class BlockManagerAdminServicer(MutatingServicer, pb_grpc.BlockManagerAdminServicer):
    def __init__(self, runtime: ServiceRuntime, defrag: DefragRunner) -> None:
        super().__init__(runtime)
        self.defrag = defrag

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        rt = self.runtime
        if rt.phase in ("recovering", "standby"):
            return pb.StatusResponse(
                state=rt.phase, uptime_s=rt.uptime_s, store=rt.store_kind, last_seq_no=rt.followed_seq_no
            )
        core = rt.state.core
        pools = []
        for pid in core.pool_ids:
            m = core.metrics(pid)
            pools.append(
                pb.PoolStatus(
                    pool_id=m.pool_id,
                    num_blocks=m.num_blocks,
                    block_size=m.block_size,
                    num_free_blocks=m.num_free_blocks,
                    num_used_blocks=m.num_used_blocks,
                    num_cached_blocks=m.num_cached_blocks,
                    num_reserved_blocks=m.num_reserved_blocks,
                    usage=m.usage,
                    high_water_mark=m.high_water_mark,
                    num_tokens=m.num_tokens,
                    waste_slots=m.waste_slots,
                    prefix_query_tokens=m.prefix_query_tokens,
                    prefix_hit_tokens=m.prefix_hit_tokens,
                    cow_copies=m.cow_copies,
                    evictions=m.evictions,
                    defrag_moves=m.defrag_moves,
                    compaction_plans=m.compaction_plans,
                    contiguity_plans=m.contiguity_plans,
                    aborted_plans=m.aborted_plans,
                    num_sequences=m.num_sequences,
                    contiguity=m.contiguity,
                    open_step=core.open_step_id(pid),
                    settled_step=core.settled_step_id(pid),
                    scheduler_id=(lease.scheduler_id if (lease := rt.state.leases.get(pid)) else ""),
                    **host_status(core.host_metrics(pid)),
                    **disk_status(core.disk_metrics(pid)),
                )
            )
        return pb.StatusResponse(
            state=rt.phase,
            num_nodes=rt.state.registry.num_active,
            num_sequences=sum(p.num_sequences for p in pools),
            pools=pools,
            last_seq_no=rt.writer.last_seq_no,
            uptime_s=rt.uptime_s,
            store=rt.store_kind,
            leader_epoch=int(getattr(rt.store, "epoch", 0)),
        )

    async def ListSchedulers(
        self, request: pb.ListSchedulersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSchedulersResponse:
        """The fleet's live members (service/fleet.py)."""
        self.runtime.check_readable()
        return pb.ListSchedulersResponse(schedulers=[pb.SchedulerInfo(**m) for m in self.runtime.fleet.members()])

    async def ListNodes(self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext) -> pb.ListNodesResponse:
        self.runtime.check_readable()
        now = self.runtime.clock()
        nodes = []
        for n in self.runtime.state.registry.nodes():
            g = n.geometry
            nodes.append(
                pb.NodeInfo(
                    node_id=n.node_id,
                    pool_id=n.node_id,
                    epoch=n.epoch,
                    address=n.address,
                    geometry=pb.KvGeometry(
                        num_layers=g.get("num_layers", 0),
                        num_kv_heads=g.get("num_kv_heads", 0),
                        head_dim=g.get("head_dim", 0),
                        dtype=g.get("dtype", ""),
                        device=g.get("device", ""),
                    ),
                    num_blocks=n.num_blocks,
                    block_size=n.block_size,
                    draining=n.draining,
                    fenced=n.fenced,
                    lease_remaining_s=0.0 if n.fenced else n.lease_deadline - now,
                )
            )
        return pb.ListNodesResponse(nodes=nodes)

    async def ListSequences(
        self, request: pb.ListSequencesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSequencesResponse:
        self.runtime.check_readable()
        state = self.runtime.state
        pool_id = check_optional_str("pool_id", request.pool_id or None, 128)
        if pool_id is not None:
            state.registry.check_active(pool_id)
        limit = min(request.limit or MAX_LIST, MAX_LIST)
        views = state.core.sequences(PoolId(pool_id) if pool_id else None)
        views.sort(key=lambda v: v.seq_id)
        return pb.ListSequencesResponse(
            sequences=[
                pb.SequenceTable(
                    seq_id=v.seq_id,
                    pool_id=v.pool_id,
                    block_table=v.block_table,
                    num_tokens=v.num_tokens,
                    version=v.version,
                )
                for v in views[:limit]
            ],
            truncated=len(views) > limit,
        )

    async def DescribeSequence(
        self, request: pb.DescribeSequenceRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeSequenceResponse:
        self.runtime.check_readable()
        state = self.runtime.state
        v = state.core.get_sequence(SeqId(check_id("seq_id", request.seq_id)))
        node = state.registry.get(v.pool_id)
        return pb.DescribeSequenceResponse(
            table=pb.SequenceTable(
                seq_id=v.seq_id,
                pool_id=v.pool_id,
                block_table=v.block_table,
                num_tokens=v.num_tokens,
                version=v.version,
            ),
            block_size=node.block_size,
            num_blocks=len(v.block_table),
        )

    async def DrainNode(self, request: pb.DrainNodeRequest, context: grpc.aio.ServicerContext) -> pb.DrainNodeResponse:
        payload = {"node_id": request.node_id, "draining": not request.undrain}
        r = await self._mutate("DrainNode", request, "drain_node", payload)
        return pb.DrainNodeResponse(num_sequences=r["num_sequences"])

    async def Fsck(self, request: pb.FsckRequest, context: grpc.aio.ServicerContext) -> pb.FsckResponse:
        self.runtime.check_readable()
        problems = self.runtime.state.fsck()
        return pb.FsckResponse(ok=not problems, problems=problems)

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        payload = {"pool_id": request.pool_id or None}
        r = await self._mutate("ResetPrefixCache", request, "reset_prefix_cache", payload)
        return pb.ResetPrefixCacheResponse(num_blocks_reset=r["num_blocks_reset"])

    async def TriggerDefrag(
        self, request: pb.TriggerDefragRequest, context: grpc.aio.ServicerContext
    ) -> pb.TriggerDefragResponse:
        rid = check_request_id(request.request_id)
        kind = defrag_kind(request.kind)
        digest = request_digest("TriggerDefrag", request)
        plans = await self.defrag.trigger(request.pool_id or None, kind, rid, digest, session_of(request))
        return pb.TriggerDefragResponse(plans=[plan_pb(p) for p in plans])


__all__ = ["BlockManagerAdminServicer"]
