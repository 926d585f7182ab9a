"""Protocol <-> dataclass translation for the client (protos stop here).

Request builders take plain Python values and return the request message; parsers take the
response message and return core / client dataclasses. Both clients (sync and aio) share them,
so the two cannot drift apart. A `PoolStep` is decoded for the caller's inspection but also
kept as the message itself (`PoolStepInfo.message`), which the scheduler passes verbatim to the
pool's compute node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from block_manager.client.errors import error_for, status_code_from_int
from block_manager.client.types import (
    FleetAssignment,
    HeartbeatResult,
    ItemFailure,
    NodeRegistration,
    OwnedPool,
    PoolRoute,
    PoolStepInfo,
    StepSettled,
    TablesUpdate,
)
from block_manager.core.types import BlockId, CopyOp, PlanId, PoolId, SeqId, SequenceView, StepId, TableDelta
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import common_pb2


def sequence_view(m: pb.SequenceTable) -> SequenceView:
    return SequenceView(
        SeqId(m.seq_id), PoolId(m.pool_id), tuple(BlockId(b) for b in m.block_table), int(m.num_tokens), int(m.version)
    )


def item_failure(seq_id: str, m: pb.ItemError, method: str) -> ItemFailure:
    err = error_for(status_code_from_int(m.code), m.message, reason=m.reason, method=method)
    return ItemFailure(SeqId(seq_id), err)


def pool_step(m: common_pb2.PoolStep) -> PoolStepInfo:
    """Decode one `PoolStep` (copy ops, deltas, drops) and keep the message for the node."""
    ops = tuple(
        CopyOp(0, BlockId(s), BlockId(d), "defrag" if is_defrag else "cow")
        for s, d, is_defrag in zip(m.copy_src, m.copy_dst, m.copy_is_defrag)
    )
    deltas: list[TableDelta] = []
    rep = app = 0
    rep_pos, rep_blk, app_blk = m.replaced_positions, m.replaced_blocks, m.appended_blocks
    for i, sid in enumerate(m.delta_seq_ids):
        nr, na = m.delta_num_replaced[i], m.delta_num_appended[i]
        replaced = tuple(zip(rep_pos[rep : rep + nr], rep_blk[rep : rep + nr]))
        appended = tuple(app_blk[app : app + na])
        rep += nr
        app += na
        deltas.append(
            TableDelta(
                SeqId(sid), int(m.delta_base_versions[i]), int(m.delta_versions[i]), int(m.delta_num_tokens[i]),
                replaced, appended,  # type: ignore[arg-type]  # block ids off the wire: no BlockId() per block
            )
        )
    return PoolStepInfo(
        PoolId(m.pool_id), int(m.epoch), StepId(int(m.step_id)), ops, tuple(deltas),
        tuple(SeqId(s) for s in m.dropped_seq_ids), PlanId(m.plan_id) if m.plan_id else None, bool(m.reset),
        StepId(int(m.base_step_id)), m,
    )


def step_settled(m: pb.StepSettled) -> StepSettled:
    return StepSettled(
        PoolId(m.pool_id), int(m.settled_step), tuple(PlanId(p) for p in m.committed_plan_ids),
        tuple(PlanId(p) for p in m.aborted_plan_ids), tuple(SeqId(s) for s in m.dropped_seq_ids),
    )


# ---- data plane requests ---------------------------------------------------------------
def register_node_request(
    request_id: str, node_id: str, num_blocks: int, block_size: int, geometry: Mapping[str, Any] | None, address: str,
    host_num_blocks: int = 0, disk_num_blocks: int = 0, disk_blocks: Sequence[Any] = (),
) -> pb.RegisterNodeRequest:
    """`disk_blocks`: `common_pb2.DiskBlock` messages of the node's disk tier (docs/tiers.md)."""
    return pb.RegisterNodeRequest(
        request_id=request_id,
        node_id=node_id,
        num_blocks=num_blocks,
        block_size=block_size,
        geometry=pb.KvGeometry(**dict(geometry or {})),
        address=address,
        host_num_blocks=host_num_blocks,
        disk_num_blocks=disk_num_blocks,
        disk_blocks=list(disk_blocks),
    )


def route_request(prompts: Sequence[tuple[Sequence[int], str | None]]) -> pb.RouteRequest:
    """One request for several prompts (`(token_ids, salt)` each)."""
    m = pb.RouteRequest()
    salts: dict[str, int] = {}
    for tokens, salt in prompts:
        m.num_token_ids.append(len(tokens))
        m.token_ids.extend(tokens)
        if salt is None:
            m.salt_index.append(-1)
        else:
            m.salt_index.append(salts.setdefault(salt, len(salts)))
    m.salts.extend(salts)
    return m


# ---- data plane responses --------------------------------------------------------------
def registration(m: pb.RegisterNodeResponse) -> NodeRegistration:
    return NodeRegistration(
        PoolId(m.pool_id),
        int(m.epoch),
        float(m.lease_ttl_s),
        int(m.block_size),
        int(m.num_blocks),
        int(m.prefetch_window),
    )


def heartbeat(m: pb.HeartbeatResponse) -> HeartbeatResult:
    return HeartbeatResult(float(m.lease_ttl_s), bool(m.draining))


def tables_update(m: pb.GetTablesResponse) -> TablesUpdate:
    return TablesUpdate(tuple(sequence_view(t) for t in m.tables), int(m.last_step_id))


def route_entries(entries: Any) -> list[PoolRoute]:
    return [PoolRoute(PoolId(e.pool_id), int(e.num_cached_tokens), int(e.num_free_blocks), e.address,
                      int(e.num_fetchable_tokens), int(e.num_missing_tokens), e.fetch_pool_id,
                      e.scheduler_id, e.scheduler_address, int(e.scheduler_num_running),
                      int(e.scheduler_num_waiting)) for e in entries]


def scheduler_heartbeat_request(
    scheduler_id: str, address: str, pin_pool_ids: Sequence[str], num_running: int, num_waiting: int,
    released_pool_ids: Sequence[str], leave: bool,
) -> pb.SchedulerHeartbeatRequest:
    return pb.SchedulerHeartbeatRequest(
        scheduler_id=scheduler_id, address=address, pin_pool_ids=list(pin_pool_ids), num_running=num_running,
        num_waiting=num_waiting, released_pool_ids=list(released_pool_ids), leave=leave,
    )


def fleet_assignment(m: pb.SchedulerHeartbeatResponse) -> FleetAssignment:
    return FleetAssignment(
        tuple(OwnedPool(p.pool_id, p.address, int(p.lease_epoch)) for p in m.pools),
        tuple(m.release_pool_ids), float(m.ttl_s), tuple(m.lending_pool_ids),
    )


def routes(m: pb.RouteResponse) -> list[PoolRoute]:
    return route_entries(m.entries)


__all__ = [
    "fleet_assignment",
    "heartbeat",
    "item_failure",
    "pool_step",
    "register_node_request",
    "registration",
    "route_entries",
    "route_request",
    "routes",
    "scheduler_heartbeat_request",
    "sequence_view",
    "step_settled",
    "tables_update",
]
