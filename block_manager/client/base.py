"""The data-plane client's core, written once under the sync and async faces.

The two clients differ only in how they wait for an answer (`grpc` blocks, `grpc.aio` is
awaited). Everything else (sessions, the step's request and answer, reports, retries'
request ids, the conversions) is here, in *operations*: generators that yield each RPC they
need as a `Call` and receive its reply (or have its `BlockManagerError` thrown in). The sync
face runs an operation with `BlockManagerClient._run`, the async face with
`AsyncBlockManagerClient._run`: those two small loops are the only code the faces repeat, so
a fix to, say, the session handshake cannot reach one client and miss the other.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from block_manager.client import wire
from block_manager.client.errors import BlockManagerError
from block_manager.client.retry import RETRYABLE_CODES, ClientStats, RetryPolicy, new_request_id, request_id_or_new
from block_manager.client.session import ClientSessionState
from block_manager.client.step import SequenceTracker, StepBatch, StepResult
from block_manager.client.types import (
    FleetAssignment,
    HeartbeatResult,
    NodeRegistration,
    PoolRoute,
    PoolStepInfo,
    TablesUpdate,
)
from pagedkv.auth import token_metadata
from pagedkv.endpoints import DEFAULT_FAILOVER_S, Endpoints
from pagedkv.tls import TlsSettings
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 5.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class Call:
    """One RPC an operation needs: the face sends it (with retries) and hands back the reply."""

    method: str
    request: Any
    timeout_s: float | None = None


# An operation: yields the calls it needs, receives their replies, returns its result.
Operation = Generator[Call, Any, T]


class ClientBase:
    """Data plane of one block manager. Use as a context manager or call `close()`.

    `scheduler_id` names this scheduler for the pools' leases: one scheduler drives a pool at a
    time, and every step of this client (and of its processes' successors that reuse the id)
    renews it. `block_sizes` (pool id -> block size) lets the step helper answer in-block
    decode appends locally; pools registered through this client are learned automatically.

    Security: `tls` (a `pagedkv.tls.TlsSettings`: the CA that verifies the server, and the
    client certificate for mutual TLS) and `token` (a bearer token sent with every call);
    neither given: plaintext, no credentials (loopback development).

    Exactly-once: mutating calls (RegisterNode, Step) run in a block-manager session
    (`client/session.py`): a resend is answered from the server's record or refused as expired,
    never applied twice, however late it comes. `sessions=False` (or a server without
    `OpenSession`) falls back to request ids alone.
    Failover: `target` may list several block managers (`"bm-0:50051,bm-1:50051"`) or name one
    DNS name with several records (a headless Service); calls go to one, and a retried call
    (UNAVAILABLE, DEADLINE_EXCEEDED: a standby or a dead leader) moves to the next and keeps
    trying for `failover_s`, resent under its request id (`pagedkv.endpoints`).
    """

    def __init__(
        self,
        target: str,
        channel: Any | None,
        aio: bool,
        *,
        timeout_s: float,
        retry: RetryPolicy | None,
        block_sizes: Mapping[str, int] | None,
        seed: int | None,
        scheduler_id: str | None,
        tls: TlsSettings | None = None,
        token: str | None = None,
        sessions: bool = True,
        failover_s: float = DEFAULT_FAILOVER_S,
    ) -> None:
        self.target = target
        self.failover_s = failover_s
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.scheduler_id = scheduler_id or f"scheduler-{uuid.uuid4().hex[:12]}"
        self._own_channel = channel is None
        self._fixed_channel = channel
        self._endpoints = None if channel is not None else Endpoints(target, tls, CHANNEL_OPTIONS, aio=aio)
        self._stubs: dict[int, pb_grpc.BlockManagerStub] = {}
        self._metadata = token_metadata(token)
        self._rng = random.Random(seed)
        self.stats = ClientStats()
        self.tracker = SequenceTracker(block_sizes)
        # pool -> (node epoch, completed_up_to, failed_from): sent with the next step
        self._reports: dict[str, tuple[int, int, int]] = {}
        self.held_pools: set[str] = set()   # pools whose lease this scheduler took
        self.session = ClientSessionState(enabled=sessions)

    def _open_session_request(self) -> pb.OpenSessionRequest:
        return pb.OpenSessionRequest(client_name=self.scheduler_id[:128])

    def _session_failed(self, exc: BaseException) -> None:
        """`_open_session` failed: UNIMPLEMENTED turns sessions off (an older server, the
        in-process block manager); anything else propagates."""
        if isinstance(exc, BlockManagerError) and exc.code.name == "UNIMPLEMENTED":
            self.session.disable()
            self.stats.errors -= 1   # a capability probe answered, not a failed call
            return
        raise exc

    def _after_mutating(self, request: Any, exc: BlockManagerError | None) -> None:
        """The outcome of a stamped request: definite (answer or refusal) settles its number;
        UNAVAILABLE / deadline leave it open for a resend."""
        self.session.returned(request)
        if exc is None or exc.code not in RETRYABLE_CODES:
            self.session.settle(request)
        if exc is not None:
            self.session.lost(exc.message)

    @property
    def _channel(self) -> Any:
        return self._fixed_channel if self._endpoints is None else self._endpoints.channel()

    @property
    def _stub(self) -> pb_grpc.BlockManagerStub:
        channel = self._channel
        stub = self._stubs.get(id(channel))
        if stub is None:
            stub = self._stubs[id(channel)] = pb_grpc.BlockManagerStub(channel)
        return stub

    @property
    def address(self) -> str:
        """The block manager calls go to now."""
        return self.target if self._endpoints is None else self._endpoints.current

    def _retry_policy(self) -> RetryPolicy:
        if self._endpoints is None or self.retry.max_attempts < 2:
            return self.retry
        return self._endpoints.retry_policy(self.retry, self.failover_s)

    def _on_attempt(self, method: str, retry: bool) -> None:
        if retry and self._endpoints is not None:
            self._endpoints.advance()
        self.stats.record_attempt(method, retry)

    def _owned_channels(self) -> list[Any]:
        if self._endpoints is None:
            return []
        self._stubs.clear()
        return self._endpoints.close_all()

    def report(self, step: PoolStepInfo, ok: bool) -> None:
        """Record the outcome of the Forward that carried `step` (sent with the next step).
        `ok=False`: the Forward did not run (or its outcome is unknown and will not be
        retried): the server drops the sequences that step wrote."""
        epoch, done, failed = self._reports.get(step.pool_id, (step.epoch, 0, 0))
        if epoch != step.epoch:
            done, failed = 0, 0  # the pool was re-registered: the old epoch's reports are moot
        if failed:
            return  # already failing from an earlier step; later steps fail with it
        if ok:
            done = max(done, step.step_id)
        else:
            done, failed = max(done, step.step_id - 1), step.step_id
        self._reports[step.pool_id] = (step.epoch, done, failed)

    @property
    def pending_reports(self) -> dict[str, tuple[int, int, int]]:
        """Forward reports not sent yet, by pool: (epoch, completed_up_to, failed_from)."""
        return dict(self._reports)

    def _begin(self, batch: StepBatch, request_id: str) -> pb.StepRequest | None:
        """The request of `batch` with the pending reports (None: nothing to send)."""
        return batch.build(request_id, self.scheduler_id, self._reports)

    def _sent(self, request: pb.StepRequest, reply: pb.StepResponse) -> None:
        """The reports in `request` reached the server (its answer arrived)."""
        for r in request.reports:
            if self._reports.get(r.pool_id) == (r.epoch, r.completed_up_to, r.failed_from):
                del self._reports[r.pool_id]
        self.held_pools.update(reply.lease_epochs)

    # ---- operations (run by a face's `_run`) ------------------------------------------
    def _mutating(self, call: Call) -> Operation[Any]:
        """`call` inside this client's session (opened on first use; see the class docstring)."""
        if self.session.needs_open():
            try:
                self.session.adopt((yield Call("OpenSession", self._open_session_request(), call.timeout_s)))
            except BlockManagerError as exc:
                self._session_failed(exc)
        self.session.stamp(call.request)
        try:
            reply = yield call
        except BlockManagerError as exc:
            self._after_mutating(call.request, exc)
            raise
        self._after_mutating(call.request, None)
        return reply

    def _commit_op(self, batch: StepBatch, request_id: str | None, timeout_s: float | None) -> Operation[StepResult]:
        """Send `batch` (at most one RPC) and apply its answer; an error leaves the batch
        distrusted (its request kept for `resend`)."""
        sent = yield from self._send_op(batch, request_id, timeout_s)
        if sent is None:
            return batch.result
        return self._apply_reply(batch, *sent)

    def _send_op(
        self, batch: StepBatch, request_id: str | None, timeout_s: float | None,
    ) -> Operation[tuple[pb.StepRequest, pb.StepResponse] | None]:
        """`_commit_op` up to the answer: the request and its reply (None: nothing to send)."""
        request = self._begin(batch, request_id or new_request_id())
        if request is None:
            return None
        try:
            reply = yield from self._mutating(Call("Step", request, timeout_s))
        except BlockManagerError:
            batch.distrust(request)
            raise
        return request, reply

    def _apply_reply(self, batch: StepBatch, request: pb.StepRequest, reply: pb.StepResponse) -> StepResult:
        self._sent(request, reply)
        return batch.apply(reply)

    def _resend_op(self, batch: StepBatch, timeout_s: float | None) -> Operation[StepResult]:
        """Send the request of a failed `commit` again, same request id."""
        request = batch.unanswered()
        reply = yield from self._mutating(Call("Step", request, timeout_s))
        batch.answered()
        self._sent(request, reply)
        return batch.apply(reply)

    def _register_op(
        self, node_id: str, num_blocks: int, block_size: int, geometry: Mapping[str, Any] | None, address: str,
        host_num_blocks: int, disk_num_blocks: int, disk_blocks: Sequence[Any], request_id: str | None,
        timeout_s: float | None,
    ) -> Operation[NodeRegistration]:
        req = wire.register_node_request(
            request_id_or_new(request_id), node_id, num_blocks, block_size, geometry, address, host_num_blocks,
            disk_num_blocks, disk_blocks,
        )
        reg = wire.registration((yield from self._mutating(Call("RegisterNode", req, timeout_s))))
        self.tracker.set_block_size(reg.pool_id, reg.block_size)
        return reg

    def _heartbeat_op(self, node_id: str, epoch: int, timeout_s: float | None) -> Operation[HeartbeatResult]:
        return wire.heartbeat((yield Call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, epoch=epoch), timeout_s)))

    def _scheduler_heartbeat_op(
        self, address: str, pin_pool_ids: Sequence[str], num_running: int, num_waiting: int,
        released_pool_ids: Sequence[str], leave: bool, timeout_s: float | None,
    ) -> Operation[FleetAssignment]:
        """One fleet heartbeat of this scheduler (`scheduler_id`). Safe to resend as is: a
        release of a pool no longer held, a second leave, a repeated renewal change nothing."""
        req = wire.scheduler_heartbeat_request(
            self.scheduler_id, address, pin_pool_ids, num_running, num_waiting, released_pool_ids, leave)
        return wire.fleet_assignment((yield Call("SchedulerHeartbeat", req, timeout_s)))

    def _deliver_grants_op(self, batch: StepBatch, timeout_s: float | None) -> Operation[StepResult]:
        """A Step with nothing in it but the pending reports: it closes the open steps of this
        member's pools that hold serve grants (their PoolSteps come back for the nodes)."""
        batch.flush = True
        batch.force = True
        return (yield from self._commit_op(batch, None, timeout_s))

    def _flush_op(self, batch: StepBatch, timeout_s: float | None) -> Operation[StepResult | None]:
        if not self._reports:
            return None
        batch.flush = True
        return (yield from self._commit_op(batch, None, timeout_s))

    def _release_op(self, batch: StepBatch, timeout_s: float | None) -> Operation[None]:
        batch.release = True
        yield from self._commit_op(batch, None, timeout_s)
        self.held_pools.clear()

    def _free_op(self, batch: StepBatch, seq_ids: Sequence[str], timeout_s: float | None) -> Operation[int]:
        batch.free(seq_ids)
        return (yield from self._commit_op(batch, None, timeout_s)).num_freed

    def _tables_op(
        self, node_id: str, epoch: int, seq_ids: Sequence[str], known_versions: Mapping[str, int] | None,
        timeout_s: float | None,
    ) -> Operation[TablesUpdate]:
        req = pb.GetTablesRequest(
            node_id=node_id, epoch=epoch, seq_ids=list(seq_ids), known_versions=dict(known_versions or {})
        )
        return wire.tables_update((yield Call("GetTables", req, timeout_s)))

    def _route_op(
        self, token_ids: Sequence[int], salt: str | None, timeout_s: float | None
    ) -> Operation[list[PoolRoute]]:
        return wire.routes((yield Call("Route", self._route_request(token_ids, salt), timeout_s)))

    def _route_many_op(
        self, prompts: Sequence[tuple[Sequence[int], str | None]], timeout_s: float | None
    ) -> Operation[list[list[PoolRoute]]]:
        return self._route_many((yield Call("Route", wire.route_request(prompts), timeout_s)))

    @staticmethod
    def _route_request(token_ids: Sequence[int], salt: str | None) -> pb.RouteRequest:
        req = pb.RouteRequest(token_ids=list(token_ids))
        if salt is not None:
            req.salt = salt
        return req

    @staticmethod
    def _route_many(reply: pb.RouteResponse) -> list[list[PoolRoute]]:
        return [wire.route_entries(r.entries) for r in reply.results]


__all__ = ["CHANNEL_OPTIONS", "DEFAULT_TIMEOUT_S", "Call", "ClientBase", "Operation"]
