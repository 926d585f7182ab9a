"""State shared by the sync and async data-plane clients (they differ only in transport)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from block_manager.client import wire
from block_manager.client.errors import BlockManagerError
from block_manager.client.retry import RETRYABLE_CODES, ClientStats, RetryPolicy
from block_manager.client.session import ClientSessionState
from block_manager.client.step import SequenceTracker, StepBatch
from block_manager.client.types import PoolStepInfo
from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 5.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


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
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.scheduler_id = scheduler_id or f"scheduler-{uuid.uuid4().hex[:12]}"
        self._own_channel = channel is None
        self._channel = channel if channel is not None else open_channel(target, tls, CHANNEL_OPTIONS, aio=aio)
        self._metadata = token_metadata(token)
        self._stub = pb_grpc.BlockManagerStub(self._channel)
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
        if exc is None or exc.code not in RETRYABLE_CODES:
            self.session.settle(request)
        if exc is not None:
            self.session.lost(exc.message)

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
        return batch.build(request_id, self.scheduler_id, self._reports)

    def _sent(self, request: pb.StepRequest, reply: pb.StepResponse) -> None:
        """The reports in `request` reached the server (its answer arrived)."""
        for r in request.reports:
            if self._reports.get(r.pool_id) == (r.epoch, r.completed_up_to, r.failed_from):
                del self._reports[r.pool_id]
        self.held_pools.update(reply.lease_epochs)

    @staticmethod
    def _route_request(token_ids: Sequence[int], salt: str | None) -> pb.RouteRequest:
        req = pb.RouteRequest(token_ids=list(token_ids))
        if salt is not None:
            req.salt = salt
        return req

    @staticmethod
    def _route_many(reply: pb.RouteResponse) -> list[list[Any]]:
        return [wire.route_entries(r.entries) for r in reply.results]
