"""Data-plane servicer: protobuf ↔ JSON-shaped payload/result, no logic.

Each mutating RPC becomes `runtime.mutate(op, request_id, digest, payload)`; the digest is a
sha256 of the deterministic protobuf encoding of the request with its `request_id` cleared
(plus the method name), which is what a retry is compared against. Errors are not handled
here: they propagate to `ErrorMappingInterceptor`.

`Step` is the hot path: its columns are copied into the payload as lists (`list(repeated)`
runs in C) and the result's columns are `extend`ed into the response; nothing is built per
item in Python except the per-item errors, which are rare.
"""

from __future__ import annotations

from typing import Any

import grpc

from block_manager.core.errors import FailedPrecondition, InvalidRequest
from block_manager.core.types import SeqId
from block_manager.service.defrag_runner import DefragRunner
from block_manager.service.disk_codec import disk_register_payload, fill_disk_blocks
from block_manager.service.kv_events_codec import frame_bytes
from block_manager.service.protocol import MutatingServicer, check_request_id, request_digest, session_of
from block_manager.service.runtime import ServiceRuntime
from block_manager.service.sessions import MAX_CLIENT_NAME_LEN
from block_manager.service.state import ServiceState
from block_manager.service.state_codec import check_count, check_ids
from block_manager.service.status import code_for_reason
from pagedkv.logging import get_logger
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from pagedkv.v1 import common_pb2

log = get_logger(__name__)

MAX_ROUTE_TOKENS = 1 << 17   # the default of the `max_route_tokens` setting


def step_payload(request: pb.StepRequest) -> dict[str, Any]:
    """The Step request's columns as the journaled payload (see `step_codec.StepInput`)."""
    payload: dict[str, Any] = {"scheduler_id": request.scheduler_id}
    if request.pool_epochs:
        payload["pool_epochs"] = dict(request.pool_epochs)
    if request.reports:
        payload["reports"] = [[r.pool_id, r.epoch, r.completed_up_to, r.failed_from] for r in request.reports]
    if request.free_seq_ids:
        payload["free"] = list(request.free_seq_ids)
    if request.alloc_seq_ids:
        payload["alloc"] = {
            "seq_ids": list(request.alloc_seq_ids),
            "pools": list(request.pool_ids),
            "salts": list(request.salts),
            "pool_index": list(request.alloc_pool_index),
            "salt_index": list(request.alloc_salt_index),
            "num_token_ids": list(request.alloc_num_token_ids),
            "token_ids": list(request.alloc_token_ids),
            "num_tokens": list(request.alloc_num_tokens),
            "num_compute": list(request.alloc_num_compute),
        }
        if request.alloc_place:
            payload["alloc"]["place"] = [bool(x) for x in request.alloc_place]
            payload["alloc"]["place_pools"] = list(request.place_pool_ids)
            payload["alloc"]["admit_budget"] = int(request.admit_budget)
    if request.written_seq_ids:
        payload["written"] = _token_section(request.written_seq_ids, request.written_num_tokens,
                                            request.written_token_ids)
    if request.fork_parent_ids:
        payload["fork"] = {
            "parents": list(request.fork_parent_ids),
            "num_children": list(request.fork_num_children),
            "children": list(request.fork_child_ids),
        }
    if request.release_leases:
        payload["release"] = True
    if request.swap_out_seq_ids:
        payload["swap_out"] = list(request.swap_out_seq_ids)
    if request.swap_in_seq_ids:
        payload["swap_in"] = list(request.swap_in_seq_ids)
    if request.append_seq_ids:
        payload["append"] = _token_section(request.append_seq_ids, request.append_num_tokens,
                                           request.append_token_ids)
        if request.append_num_late:
            payload["append"]["num_late"] = list(request.append_num_late)
    if request.late_seq_ids:
        payload["late"] = _token_section(request.late_seq_ids, request.late_num_tokens, request.late_token_ids)
    return payload


def _token_section(seq_ids: Any, num_tokens: Any, token_ids: Any) -> dict[str, list[Any]]:
    """A section of per-sequence token counts with their ids back to back, as journaled."""
    return {"seq_ids": list(seq_ids), "num_tokens": list(num_tokens), "token_ids": list(token_ids)}


def fill_pool_step(msg: common_pb2.PoolStep, d: dict[str, Any]) -> None:
    """A journaled pool step (`step_codec.pool_step_dict`) into its message, column by column."""
    msg.pool_id = d["pool_id"]
    msg.epoch = d["epoch"]
    msg.step_id = d["step_id"]
    msg.copy_src.extend(d["copy_src"])
    msg.copy_dst.extend(d["copy_dst"])
    msg.copy_is_defrag.extend(d["copy_is_defrag"])
    msg.delta_seq_ids.extend(d["delta_seq_ids"])
    msg.delta_base_versions.extend(d["delta_base_versions"])
    msg.delta_versions.extend(d["delta_versions"])
    msg.delta_num_tokens.extend(d["delta_num_tokens"])
    msg.delta_num_replaced.extend(d["delta_num_replaced"])
    msg.replaced_positions.extend(d["replaced_positions"])
    msg.replaced_blocks.extend(d["replaced_blocks"])
    msg.delta_num_appended.extend(d["delta_num_appended"])
    msg.appended_blocks.extend(d["appended_blocks"])
    msg.dropped_seq_ids.extend(d["dropped_seq_ids"])
    msg.plan_id = d["plan_id"]
    msg.reset = d["reset"]
    msg.base_step_id = d["base_step_id"]
    for fid, src, address, src_blocks, dst_blocks, seq_id, first, tokens, src_host in d.get("fetches", ()):
        msg.fetches.add(fetch_id=fid, src_pool_id=src, src_address=address, src_blocks=src_blocks,
                        dst_blocks=dst_blocks, seq_id=seq_id, first_token=first, token_ids=tokens, src_host=src_host)
    for fid, dst, blocks, host in d.get("serves", ()):
        msg.serves.add(fetch_id=fid, dst_pool_id=dst, blocks=blocks, host=host)
    if "tier_kind" in d:   # host tier moves (absent in steps without any)
        msg.tier_kind.extend(d["tier_kind"])
        msg.tier_src.extend(d["tier_src"])
        msg.tier_dst.extend(d["tier_dst"])
        fill_disk_blocks(msg, d.get("disk_blocks", ()))


def step_response(r: dict[str, Any]) -> pb.StepResponse:
    resp = pb.StepResponse()
    for d in r["steps"]:
        fill_pool_step(resp.steps.add(), d)
    for pool_id, settled_step, committed, aborted, dropped in r["settled"]:
        s = resp.settled.add()
        s.pool_id, s.settled_step = pool_id, settled_step
        s.committed_plan_ids.extend(committed)
        s.aborted_plan_ids.extend(aborted)
        s.dropped_seq_ids.extend(dropped)
    for section, index, reason, message in r["errors"]:
        e = resp.errors.add()
        e.code, e.reason, e.message = code_for_reason(reason).value[0], reason, message
        e.section, e.index = section, index
    resp.alloc_num_cached_tokens.extend(r["alloc_num_cached_tokens"])
    resp.alloc_num_tokens.extend(r["alloc_num_tokens"])
    resp.append_num_tokens.extend(r["append_num_tokens"])
    resp.lease_epochs.update(r["lease_epochs"])
    resp.alloc_pool_ids.extend(r.get("alloc_pool_ids", ()))
    for pool_id, num_free, num_usable, *host in r.get("pool_free", ()):   # absent in answers journaled before it
        resp.pool_free.add(pool_id=pool_id, num_free_blocks=num_free, num_usable_blocks=num_usable,
                           host_usable_blocks=host[0] if host else 0)
    resp.swapped_out_seq_ids.extend(r.get("swapped_out", ()))
    for sid, num_tokens in r.get("swapped_in", ()):
        resp.swapped_in_seq_ids.append(sid)
        resp.swapped_in_num_tokens.append(num_tokens)
    return resp


def register_payload(request: pb.RegisterNodeRequest) -> dict[str, Any]:
    g = request.geometry
    return {
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
        **({"host_num_blocks": request.host_num_blocks} if request.host_num_blocks else {}),
        **disk_register_payload(request),
    }


def register_response(r: dict[str, Any]) -> pb.RegisterNodeResponse:
    return pb.RegisterNodeResponse(
        pool_id=r["pool_id"],
        epoch=r["epoch"],
        lease_ttl_s=r["lease_ttl_s"],
        block_size=r["block_size"],
        num_blocks=r["num_blocks"],
        prefetch_window=r["prefetch_window"],
        host_num_blocks=r.get("host_num_blocks", 0),
        disk_num_blocks=r.get("disk_num_blocks", 0),
    )


def route_response(
    state: ServiceState, request: pb.RouteRequest, max_tokens: int = MAX_ROUTE_TOKENS
) -> pb.RouteResponse:
    """Pools ranked per prompt (one prompt, or many: `num_token_ids` splits the ids)."""
    if len(request.token_ids) > max_tokens:   # before copying them
        raise InvalidRequest(f"route takes at most {max_tokens} token ids, got {len(request.token_ids)}")
    token_ids = list(request.token_ids)
    if not request.num_token_ids:
        salt = request.salt if request.HasField("salt") else None
        return pb.RouteResponse(entries=_route_entries(state, token_ids, salt))
    counts = list(request.num_token_ids)
    salts = list(request.salts)
    if len(counts) > state.config.max_batch or len(salts) > state.config.max_batch:
        raise InvalidRequest(f"route takes at most {state.config.max_batch} prompts and salts")
    if sum(counts) != len(token_ids):
        raise InvalidRequest("route: one token count per prompt, summing to the token ids given")
    if request.salt_index and len(request.salt_index) != len(counts):
        raise InvalidRequest("route: one salt index per prompt (or none)")
    resp = pb.RouteResponse()
    pos = 0
    for i, n in enumerate(counts):
        si = request.salt_index[i] if request.salt_index else -1
        if not -1 <= si < len(salts):
            raise InvalidRequest(f"route: salt index {si} out of range")
        entries = _route_entries(state, token_ids[pos : pos + n], salts[si] if si >= 0 else None)
        resp.results.add().entries.extend(entries)
        pos += n
    if resp.results:
        resp.entries.extend(resp.results[0].entries)
    return resp


def _route_entries(state: ServiceState, token_ids: list[int], salt: str | None) -> list[pb.RouteEntry]:
    out = []
    for e in state.core.route(token_ids, salt):
        node = state.registry.get(e.pool_id)
        if node.draining or node.fenced:
            continue
        out.append(
            pb.RouteEntry(
                pool_id=e.pool_id,
                num_cached_tokens=e.num_cached_tokens,
                num_free_blocks=e.num_free_blocks,
                address=node.address,
                num_fetchable_tokens=e.num_fetchable_tokens,
                num_missing_tokens=e.num_missing_tokens,
                fetch_pool_id=e.fetch_pool_id or "",
            )
        )
    return out


class BlockManagerServicer(MutatingServicer, pb_grpc.BlockManagerServicer):
    def __init__(
        self, runtime: ServiceRuntime, defrag: DefragRunner, *, max_route_tokens: int = MAX_ROUTE_TOKENS
    ) -> None:
        super().__init__(runtime)
        self.defrag = defrag
        self.max_route_tokens = max_route_tokens

    # ---- nodes ----------------------------------------------------------------------
    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNodeResponse:
        r = await self._mutate("RegisterNode", request, "register_node", register_payload(request))
        return register_response(r)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        ttl = self.runtime.heartbeat(request.node_id, request.epoch)
        node = self.runtime.state.registry.get(request.node_id)
        return pb.HeartbeatResponse(lease_ttl_s=ttl, draining=node.draining)

    # ---- the scheduler step ---------------------------------------------------------
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        rid = check_request_id(request.request_id)
        session = session_of(request)
        r = await self.runtime.mutate_step(rid, request_digest("Step", request), step_payload(request), session)
        return step_response(r)

    # ---- client sessions ------------------------------------------------------------
    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenSessionResponse:
        name = request.client_name
        if len(name) > MAX_CLIENT_NAME_LEN or not name.isprintable():
            raise InvalidRequest(f"client_name must be at most {MAX_CLIENT_NAME_LEN} printable characters")
        r = await self.runtime.open_session(name)
        return pb.OpenSessionResponse(session_id=r["session_id"], ttl_s=r["ttl_s"], window_s=r["window_s"])

    # ---- cold tables ----------------------------------------------------------------
    async def GetTables(
        self, request: pb.GetTablesRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTablesResponse:
        self.runtime.check_readable()
        state = self.runtime.state
        node = state.registry.check_epoch(request.node_id, request.epoch)
        seq_ids = [SeqId(s) for s in request.seq_ids]
        check_count("number of seq_ids", len(seq_ids), 0, state.config.max_batch)
        check_ids("seq_id", seq_ids)
        check_count("number of known_versions", len(request.known_versions), 0, state.config.max_batch)
        known = {SeqId(k): v for k, v in request.known_versions.items()}
        views = state.core.get_tables(seq_ids, known)
        for v in views:
            if v.pool_id != node.node_id:
                raise InvalidRequest(f"sequence {v.seq_id!r} is on pool {v.pool_id!r}, not {node.node_id!r}")
        resp = pb.GetTablesResponse(last_step_id=state.core.open_step_id(node.node_id) - 1)
        for v in views:
            t = resp.tables.add()
            t.seq_id, t.pool_id, t.num_tokens, t.version = v.seq_id, v.pool_id, v.num_tokens, v.version
            t.block_table.extend(v.block_table)
        return resp

    # ---- routing --------------------------------------------------------------------
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        self.runtime.check_readable()
        return route_response(self.runtime.state, request, self.max_route_tokens)

    # ---- KV events ------------------------------------------------------------------
    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Only a serving leader streams (a standby, a recovering or draining server answers
        UNAVAILABLE, like every other RPC); the stream ends UNAVAILABLE when it stops serving.
        Messages go out with `context.write`, so a subscriber that went away (the write fails)
        ends its stream quietly instead of as a servicer error."""
        self.runtime.check_writable()
        if not self.runtime.config.kv_events.enabled:
            raise FailedPrecondition("KV events are off on this block manager (kv_events.enabled)")
        hub = self.runtime.kv_events
        sub = hub.subscribe(request.from_event_id, request.live_only)
        try:
            async for frame in hub.stream(sub):
                try:
                    await context.write(frame_bytes(frame))
                except Exception as exc:  # noqa: BLE001 - the transport refused: the peer is gone
                    log.info("kv events subscriber went away", error_type=type(exc).__name__)
                    return
        finally:
            hub.unsubscribe(sub)


__all__ = [
    "BlockManagerServicer",
    "fill_pool_step",
    "register_payload",
    "register_response",
    "route_response",
    "step_payload",
    "step_response",
]
