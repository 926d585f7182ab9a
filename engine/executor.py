"""How the engine reaches a compute node that serves a model: one `Generate` per step.

`RemoteNode` calls a node process over gRPC; `LocalNode` (in `engine.local_node`) runs the
node's own step logic in this process. Both take and return the protocol messages, so the
engine has one code path and the in-process node checks exactly what a remote one checks.
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class NodeExecutor(Protocol):
    node_id: str

    def info(self, timeout_s: float | None = None) -> pb.GetNodeInfoResponse: ...

    def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse: ...

    def close(self) -> None: ...


class RemoteNode:
    """A compute node process (`compute-node serve --model DIR`).

    A node accepts `Generate` only from scheduler principals, so the engine presents the same
    credentials it presents to the block manager: `tls` (the CA that verifies the node and, for
    mutual TLS, the scheduler's client certificate) and/or `token` (the scheduler's bearer
    token). Neither: plaintext without credentials (loopback development)."""

    def __init__(
        self, node_id: str, address: str, *, timeout_s: float = 120.0,
        tls: TlsSettings | None = None, token: str | None = None,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.timeout_s = timeout_s
        self.tls = tls
        self._metadata = token_metadata(token)
        self._channel = open_channel(address, tls, CHANNEL_OPTIONS)
        self._stub = pb_grpc.ComputeNodeStub(self._channel)

    def info(self, timeout_s: float | None = None) -> pb.GetNodeInfoResponse:
        """The node's model and pool (waits for the node to come up, `timeout_s` at most)."""
        return self._stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=timeout_s or self.timeout_s,
                                      wait_for_ready=True, metadata=self._metadata)

    def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        return self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()


__all__ = ["CHANNEL_OPTIONS", "NodeExecutor", "RemoteNode"]
