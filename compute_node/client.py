"""A small synchronous client of the compute node's Forward RPC, over NumPy arrays.

    client = ComputeNodeClient("127.0.0.1:50061")
    outs = client.forward([SeqInput("s1", context_len=9, query=q, key=k, value=v)], layers=[0, 1],
                          steps=[result.steps["node-0"].message])
    # outs[i]: [num_layers, num_new_tokens, num_heads, head_dim] for sequence i

`steps` are the block manager's `PoolStep` messages for this node since its last Forward (the
scheduler passes them through from its `Step` results, in order).

Per sequence, `query`/`key`/`value` are `[num_layers, num_new_tokens, heads, head_dim]` with the
layers in the order of `layers`. The client packs every layer's tokens of the whole batch into
one tensor per layer (request order), the way the node wants them, and unpacks the outputs.
float16/float32 NumPy arrays travel as they are; bfloat16 needs torch tensors (NumPy has no
bfloat16) and comes back widened to float32.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compute_node.wire import encode_tensor, tensor_to_numpy
from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

_request_ids = itertools.count(1)


@dataclass(slots=True)
class SeqInput:
    seq_id: str
    context_len: int   # the sequence's tokens after this Forward; the new ones are its last rows
    query: Any   # [num_layers, num_new_tokens, num_heads, head_dim]
    key: Any     # [num_layers, num_new_tokens, num_kv_heads, head_dim]
    value: Any

    @property
    def num_new_tokens(self) -> int:
        """Tokens this Forward writes for the sequence (rows of its query)."""
        return int(self.query.shape[1])


@dataclass(slots=True)
class ForwardOutput:
    outputs: list[np.ndarray]    # per sequence: [num_layers, num_new_tokens, num_heads, head_dim]
    stats: pb.ForwardStats


DEFAULT_MAX_MESSAGE_BYTES = 256 << 20   # the node's own default limit


class ComputeNodeClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        tls: TlsSettings | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """`tls`: the CA that verifies the node and the scheduler's client certificate (mutual
        TLS); `token`: the scheduler's bearer token; neither: plaintext without credentials."""
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = token_metadata(token)
        limits = [("grpc.max_receive_message_length", max_message_bytes),
                  ("grpc.max_send_message_length", max_message_bytes)]
        self._channel = open_channel(address, tls, limits)
        self._stub = pb_grpc.ComputeNodeStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> ComputeNodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def node_info(self) -> pb.GetNodeInfoResponse:
        """The node's geometry and registration."""
        return self._stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=self.timeout_s, metadata=self._metadata)

    def forward_raw(self, request: pb.ForwardRequest) -> pb.ForwardResponse:
        """Send a prepared request; raises `grpc.RpcError` with the node's status."""
        return self._stub.Forward(request, timeout=self.timeout_s, metadata=self._metadata)

    def forward(
        self,
        seqs: Sequence[SeqInput],
        layers: Sequence[int],
        *,
        steps: Sequence[Any] = (),
        scale: float = 0.0,
        request_id: str | None = None,
    ) -> ForwardOutput:
        """Apply `steps` (PoolStep messages), write the sequences' K/V, attend."""
        request = build_request(seqs, layers, steps=steps, scale=scale, request_id=request_id)
        response = self.forward_raw(request)
        return ForwardOutput(split_outputs(response, seqs), response.stats)


def build_request(
    seqs: Sequence[SeqInput],
    layers: Sequence[int],
    *,
    steps: Sequence[Any] = (),
    scale: float = 0.0,
    request_id: str | None = None,
) -> pb.ForwardRequest:
    """Pack per-sequence arrays into one tensor per layer (tokens in request order)."""
    layer_msgs = []
    for li, layer in enumerate(layers if seqs else ()):
        q = _concat([s.query[li] for s in seqs])
        k = _concat([s.key[li] for s in seqs])
        v = _concat([s.value[li] for s in seqs])
        layer_msgs.append(
            pb.LayerInput(layer=layer, query=encode_tensor(q), key=encode_tensor(k), value=encode_tensor(v))
        )
    request = pb.ForwardRequest(
        request_id=request_id or f"fwd-{os.getpid()}-{next(_request_ids)}",
        sequences=[
            pb.ForwardSequence(seq_id=s.seq_id, num_new_tokens=s.num_new_tokens, context_len=s.context_len)
            for s in seqs
        ],
        layers=layer_msgs,
        scale=scale,
    )
    request.steps.extend(steps)
    return request


def split_outputs(response: pb.ForwardResponse, seqs: Sequence[SeqInput]) -> list[np.ndarray]:
    """Per-sequence `[num_layers, num_new_tokens, num_heads, head_dim]` from per-layer outputs."""
    per_layer = [tensor_to_numpy(o.output, f"outputs[{o.layer}]") for o in response.outputs]
    stacked = np.stack(per_layer) if per_layer else np.empty((0,))
    result, row = [], 0
    for s in seqs:
        n = s.num_new_tokens
        result.append(stacked[:, row : row + n])
        row += n
    return result


def _concat(parts: list[Any]) -> Any:
    if any(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat([torch.as_tensor(p) for p in parts])
    return np.concatenate([np.asarray(p) for p in parts])
