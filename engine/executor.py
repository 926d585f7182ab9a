"""How the engine reaches a compute node that serves a model: one `Generate` per step.

`RemoteNode` calls a node process over gRPC; `LocalNode` (in `engine.local_node`) runs the
node's own step logic in this process. Both take and return the protocol messages, so the
engine has one code path and the in-process node checks exactly what a remote one checks.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class NodeExecutor(Protocol):
    node_id: str

    def info(self) -> pb.GetNodeInfoResponse: ...

    def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse: ...

    def close(self) -> None: ...


class RemoteNode:
    """A compute node process (`compute-node serve --model DIR`)."""

    def __init__(self, node_id: str, address: str, *, timeout_s: float = 120.0) -> None:
        self.node_id = node_id
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.ComputeNodeStub(self._channel)

    def info(self) -> pb.GetNodeInfoResponse:
        return self._stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=self.timeout_s, wait_for_ready=True)

    def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        return self._stub.Generate(request, timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()


__all__ = ["CHANNEL_OPTIONS", "NodeExecutor", "RemoteNode"]
