"""Data-plane servicer: protobuf ↔ JSON-shaped payload/result, no logic.

Each mutating RPC becomes `runtime.mutate(op, request_id, digest, payload)`; the digest is a
sha256 of the deterministic protobuf encoding of the request with its `request_id` cleared
(plus the method name), which is what a retry is compared against. Errors are not handled
here: they propagate to `ErrorMappingInterceptor`.

`Step` is the hot path and has no payload dict: the message is decoded once into the state
machine's columns, encoded once (its digest and its journal record share those bytes), and the
answer's columns are `extend`ed into the response once, whose bytes are the journaled answer;
nothing is built per item in Python except the per-item errors, which are rare. The conversions
live with their typed values: `step_codec.py` (the request, `ReceivedStep`) and `step_answer.py`
(the answer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from block_manager.core.errors import FailedPrecondition, InvalidRequest
from block_manager.core.fleet import Member
from block_manager.core.types import SeqId
from block_manager.service.defrag_runner import DefragRunner
from block_manager.service.disk_codec import disk_register_payload
from block_manager.service.fleet import Assignment
from block_manager.service.kv_events_codec import frame_bytes
from block_manager.service.protocol import MutatingServicer, check_request_id, session_of
from block_manager.service.runtime import ServiceRuntime
from block_manager.service.sessions import MAX_CLIENT_NAME_LEN
from block_manager.service.state import ServiceState
from block_manager.service.state_codec import check_count, check_ids
from block_manager.service.step_answer import StepAnswer, fill_pool_step
from block_manager.service.step_codec import STEP_ANSWER_FORMAT, ReceivedStep, step_payload
from block_manager.store.records import Body, Packed
from pagedkv.logging import get_logger
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

log = get_logger(__name__)

MAX_ROUTE_TOKENS = 1 << 17   # the default of the `max_route_tokens` setting


def step_response(r: Body | StepAnswer) -> pb.StepResponse:
    """A Step answer as the response: a recorded one (packed: its `StepResponse` bytes; or the
    JSON form journaled before those), or a `StepAnswer` (embedded mode)."""
    if isinstance(r, StepAnswer):
        return r.fill(pb.StepResponse())
    if isinstance(r, Packed):
        if r.format != STEP_ANSWER_FORMAT:
            raise InvalidRequest(f"the recorded answer is not a Step's ({r.format!r})")
        return pb.StepResponse.FromString(r.data)
    return StepAnswer.from_json(r).fill(pb.StepResponse())


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
    state: ServiceState, request: pb.RouteRequest, max_tokens: int = MAX_ROUTE_TOKENS,
    owner: Callable[[str], Member | None] | None = None,
) -> pb.RouteResponse:
    """Pools ranked per prompt (one prompt, or many: `num_token_ids` splits the ids);
    `owner`: the fleet member owning a pool (fills the entries' scheduler fields)."""
    if len(request.token_ids) > max_tokens:   # before copying them
        raise InvalidRequest(f"route takes at most {max_tokens} token ids, got {len(request.token_ids)}")
    token_ids = list(request.token_ids)
    if not request.num_token_ids:
        salt = request.salt if request.HasField("salt") else None
        return pb.RouteResponse(entries=_route_entries(state, token_ids, salt, owner))
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
        entries = _route_entries(state, token_ids[pos : pos + n], salts[si] if si >= 0 else None, owner)
        resp.results.add().entries.extend(entries)
        pos += n
    if resp.results:
        resp.entries.extend(resp.results[0].entries)
    return resp


def _route_entries(
    state: ServiceState, token_ids: list[int], salt: str | None, owner: Callable[[str], Member | None] | None,
) -> list[pb.RouteEntry]:
    out = []
    for e in state.core.route(token_ids, salt):
        node = state.registry.get(e.pool_id)
        if node.draining or node.fenced:
            continue
        entry = pb.RouteEntry(
            pool_id=e.pool_id,
            num_cached_tokens=e.num_cached_tokens,
            num_free_blocks=e.num_free_blocks,
            address=node.address,
            num_fetchable_tokens=e.num_fetchable_tokens,
            num_missing_tokens=e.num_missing_tokens,
            fetch_pool_id=e.fetch_pool_id or "",
        )
        member = owner(e.pool_id) if owner is not None else None
        if member is not None:
            entry.scheduler_id = member.scheduler_id
            entry.scheduler_address = member.address
            entry.scheduler_num_running = member.num_running
            entry.scheduler_num_waiting = member.num_waiting
        out.append(entry)
    return out


def assignment_response(a: Assignment) -> pb.SchedulerHeartbeatResponse:
    return pb.SchedulerHeartbeatResponse(
        pools=[pb.OwnedPool(pool_id=p.pool_id, address=p.address, lease_epoch=p.lease_epoch) for p in a.pools],
        release_pool_ids=a.release_pool_ids, ttl_s=a.ttl_s, lending_pool_ids=a.lending_pool_ids,
    )


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
        """One message each way: the request's bytes are digested and journaled as they are
        encoded once (`ReceivedStep.body`), the response is filled once from the answer and its
        bytes journaled; a retry gets the recorded bytes back."""
        rid = check_request_id(request.request_id)
        session = session_of(request)
        received = ReceivedStep(request, new_response=pb.StepResponse)
        r = await self.runtime.mutate_step(rid, received.digest(), received, session)
        if r is received.recorded and received.response is not None:
            return received.response
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
        return route_response(self.runtime.state, request, self.max_route_tokens, self.runtime.fleet.owner)

    # ---- fleet mode -----------------------------------------------------------------
    async def SchedulerHeartbeat(
        self, request: pb.SchedulerHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.SchedulerHeartbeatResponse:
        a = await self.runtime.fleet.heartbeat(
            request.scheduler_id, address=request.address, pin_pool_ids=list(request.pin_pool_ids),
            num_running=request.num_running, num_waiting=request.num_waiting,
            released_pool_ids=list(request.released_pool_ids), leave=request.leave,
        )
        return assignment_response(a)

    # ---- KV events ------------------------------------------------------------------
    async def SubscribeKvEvents(  # type: ignore[override]  # it writes with context.write: no iterator
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
    "assignment_response",
    "fill_pool_step",
    "register_payload",
    "register_response",
    "route_response",
    "step_payload",
    "step_response",
]
