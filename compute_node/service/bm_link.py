"""The node's side of the block manager protocol: register, heartbeat, cold-cache tables.

A thin async wrapper over the generated stub that turns gRPC statuses into the few outcomes
the node acts on (`LinkFenced`, `LinkUnavailable`, `LinkNotFound`, `LinkRejected`) and counts
every call, so a Forward can report how many block manager round trips it cost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

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

    @property
    def _stub(self) -> bm_grpc.BlockManagerStub:
        return bm_grpc.BlockManagerStub(self._endpoints.channel())

    async def close(self) -> None:
        for channel in self._endpoints.close_all():
            await channel.close()

    async def register(
        self, *, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: str, device: str, block_size: int | None, num_blocks: int, address: str,
    ) -> Registration:
        """Register the pool; every call starts a new epoch (fencing any previous one)."""
        request = bm_pb.RegisterNodeRequest(
            request_id=f"register-{self.node_id}-{uuid.uuid4().hex}",
            node_id=self.node_id,
            num_blocks=num_blocks,
            block_size=block_size or 0,
            geometry=bm_pb.KvGeometry(
                num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device
            ),
            address=address,
        )
        reply = await self._call("RegisterNode", request)
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

    async def _call(self, method: str, request):  # type: ignore[no-untyped-def]
        self.num_rpcs += 1
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._endpoints.advance()
            raise _translate(exc) from None
