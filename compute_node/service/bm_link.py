"""The node's side of the block manager protocol: register, heartbeat, cold-cache tables.

A thin async wrapper over the generated stub that turns gRPC statuses into the few outcomes
the node acts on (`LinkFenced`, `LinkUnavailable`, `LinkNotFound`, `LinkRejected`) and counts
every call, so a Forward can report how many block manager round trips it cost.

Registration runs in a block-manager client session (opened at the node's first contact): a
RegisterNode whose answer was lost (UNAVAILABLE, deadline) is resent as is on the next try, so
the block manager answers it from its record instead of starting (and fencing) another epoch,
and a resend that comes too late is refused rather than applied again. A block manager without
sessions (UNIMPLEMENTED) gets plain requests.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from compute_node.tables import NodeTable, SeqId
from pagedkv.auth import token_metadata
from pagedkv.endpoints import Endpoints
from pagedkv.rpc import is_retryable
from pagedkv.tls import TlsSettings
from pagedkv.v1 import block_manager_pb2 as bm_pb
from pagedkv.v1 import block_manager_pb2_grpc as bm_grpc


class LinkError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class LinkUnavailable(LinkError):
    """Transient: retry later with the same epoch."""


class LinkFenced(LinkError):
    """FAILED_PRECONDITION: a stale epoch, or (for GetTables) a sequence dropped by fencing."""


class LinkNotFound(LinkError):
    """Unknown sequence or node."""


class LinkRejected(LinkError):
    """Any other refusal (INVALID_ARGUMENT, ABORTED, INTERNAL, ...)."""


@dataclass(slots=True, frozen=True)
class Registration:
    epoch: int
    lease_ttl_s: float
    block_size: int
    num_blocks: int
    prefetch_window: int


@dataclass(slots=True, frozen=True)
class TablesReply:
    tables: dict[SeqId, NodeTable]   # num_tokens: the block manager's count (may lag deferred tokens)
    last_step_id: int                # the pool's last closed step the tables reflect


def _translate(exc: grpc.aio.AioRpcError) -> LinkError:
    code, details = exc.code(), exc.details() or ""
    if is_retryable(code):
        return LinkUnavailable(code, details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return LinkFenced(code, details)
    if code == grpc.StatusCode.NOT_FOUND:
        return LinkNotFound(code, details)
    return LinkRejected(code, details)


def _same_registration(a: bm_pb.RegisterNodeRequest, b: bm_pb.RegisterNodeRequest) -> bool:
    """The same pool described the same way (ids and sessions aside)."""
    return (a.node_id, a.num_blocks, a.block_size, a.geometry, a.address, a.host_num_blocks, a.disk_num_blocks) == (
        b.node_id, b.num_blocks, b.block_size, b.geometry, b.address, b.host_num_blocks, b.disk_num_blocks
    )


class BlockManagerLink:
    """One channel to the block manager, shared by the heartbeat task and forwards."""

    def __init__(
        self, address: str, node_id: str, timeout_s: float, *, tls: TlsSettings | None = None, token: str | None = None
    ) -> None:
        """`tls`: the node's settings (its certificate is the client certificate, `ca_file`
        verifies the block manager); `token`: its bearer token there (without mTLS)."""
        self.address = address
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.num_rpcs = 0
        self._metadata = token_metadata(token)
        # gRPC's default reconnect backoff grows to minutes; a node must notice a restarted
        # block manager within a heartbeat or two, so cap it at a second. GetTables answers
        # may exceed gRPC's 4 MiB default: accept what the block manager may send.
        # `address` may list several block managers (active/standby) or name several records:
        # a call that gets UNAVAILABLE or times out moves the next one to the next address
        # (the heartbeat loop's retry then reaches the new leader; pagedkv.endpoints).
        self._endpoints = Endpoints(
            address,
            tls,
            [
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
            aio=True,
        )
        self._session_id: str | None = None
        self._session_ttl_s = 0.0
        self._session_used = 0.0   # monotonic
        self._sessions = True
        self._next_seq = 1
        self._unanswered: bm_pb.RegisterNodeRequest | None = None   # resent by the next register()

    async def _ensure_session(self) -> None:
        """A live session: opened at first contact, and again when this one has been idle for
        half its TTL (a node registers rarely; its session may expire between registrations)."""
        if not self._sessions:
            return
        if self._session_id is not None and time.monotonic() - self._session_used < self._session_ttl_s / 2:
            return
        try:
            reply = await self._call("OpenSession", bm_pb.OpenSessionRequest(client_name=self.node_id[:128]))
        except LinkRejected as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._sessions = False
            return
        self._session_id, self._next_seq = reply.session_id, 1
        self._session_ttl_s, self._session_used = reply.ttl_s, time.monotonic()

    @property
    def _stub(self) -> bm_grpc.BlockManagerStub:
        return bm_grpc.BlockManagerStub(self._endpoints.channel())

    async def close(self) -> None:
        for channel in self._endpoints.close_all():
            await channel.close()

    async def register(
        self, *, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: str, device: str, block_size: int | None, num_blocks: int, address: str,
        host_num_blocks: int = 0, disk_num_blocks: int = 0, disk_blocks: Sequence[Any] = (),
    ) -> Registration:
        """Register the pool; every call starts a new epoch (fencing any previous one) — except
        that a registration whose answer was lost is resent first (see the module docstring)."""
        request = bm_pb.RegisterNodeRequest(
            request_id=f"register-{self.node_id}-{uuid.uuid4().hex}",
            node_id=self.node_id,
            num_blocks=num_blocks,
            block_size=block_size or 0,
            geometry=bm_pb.KvGeometry(
                num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device
            ),
            address=address,
            host_num_blocks=host_num_blocks,
            disk_num_blocks=disk_num_blocks,
            disk_blocks=list(disk_blocks),
        )
        pending = self._unanswered
        if pending is not None and _same_registration(pending, request):
            request = pending
        else:
            await self._ensure_session()
            if self._session_id is not None:
                request.session.session_id, request.session.seq = self._session_id, self._next_seq
                request.session.acked = self._next_seq
                self._next_seq += 1
                self._session_used = time.monotonic()
        self._unanswered = None
        try:
            reply = await self._call("RegisterNode", request)
        except LinkUnavailable:
            self._unanswered = request   # its outcome is unknown: the next try resends it
            raise
        except LinkFenced as exc:
            if exc.details.startswith("session expired:"):
                self._session_id = None   # the next try opens a new session
            raise
        return Registration(
            epoch=int(reply.epoch),
            lease_ttl_s=float(reply.lease_ttl_s),
            block_size=int(reply.block_size),
            num_blocks=int(reply.num_blocks),
            prefetch_window=int(reply.prefetch_window),
        )

    async def heartbeat(self, epoch: int) -> bm_pb.HeartbeatResponse:
        return await self._call("Heartbeat", bm_pb.HeartbeatRequest(node_id=self.node_id, epoch=epoch))

    async def get_tables(self, epoch: int, seq_ids: list[SeqId]) -> TablesReply:
        """The current tables of `seq_ids` (a cold cache; never on the hot path)."""
        request = bm_pb.GetTablesRequest(node_id=self.node_id, epoch=epoch, seq_ids=seq_ids)
        reply = await self._call("GetTables", request)
        tables = {
            SeqId(t.seq_id): NodeTable([int(b) for b in t.block_table], int(t.version), int(t.num_tokens))
            for t in reply.tables
        }
        return TablesReply(tables, int(reply.last_step_id))

    async def _call(self, method: str, request: Any) -> Any:
        self.num_rpcs += 1
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._endpoints.advance()
            raise _translate(exc) from None
