"""How the engine reaches a compute node that serves a model: one `Generate` per step.

`RemoteNode` calls a node process over gRPC; `LocalNode` (in `engine.local_node`) runs the
node's own step logic in this process. Both turn the engine's plain `NodeStep` into the
protocol's `GenerateRequest` with the same conversion (below), so the in-process node checks
exactly what a remote one checks, and both raise the engine's typed node errors
(`engine.errors`) for a step that failed: the scheduler never sees a status code.
"""

from __future__ import annotations

import grpc

from engine.errors import NodeError, NodeMovedOn, NodeRefused, NodeUnreachable
from engine.node_api import NodeExecutor, NodeInfo, NodeStep, PromptScores, SampledToken, SamplingSpec, StepAnswer
from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# the node is gone or going: CANCELLED is a node stopping with the call in flight (the engine
# never cancels its own calls)
UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                               grpc.StatusCode.CANCELLED})
# the node restarted (new epoch: it knows neither the epoch nor the sequences), or its tables
# disagree with the step
MOVED_ON_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.ABORTED})


def node_error(node_id: str, code: grpc.StatusCode | None, details: str) -> NodeError:
    """The typed error for a node's status code."""
    name = code.name if code is not None else "UNKNOWN"
    if code in UNREACHABLE_CODES:
        return NodeUnreachable(node_id, details, code=name)
    if code in MOVED_ON_CODES:
        return NodeMovedOn(node_id, details, code=name)
    return NodeRefused(node_id, details, code=name)


def generate_request(step: NodeStep) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=step.request_id, profile=step.profile)
    for info in step.pool_steps:
        request.steps.append(info.message)
    for w in step.sequences:
        s = request.sequences.add(seq_id=w.seq_id, context_len=w.context_len, num_output_tokens=w.num_output_tokens)
        s.token_ids.extend(w.token_ids)
        if w.sampling is not None:
            _fill_sampling(s.sampling, w.sampling)
        if w.prompt_logprobs is not None:
            s.prompt_logprobs.num_top = w.prompt_logprobs.num_top
            s.prompt_logprobs.target_token_ids.extend(w.prompt_logprobs.target_token_ids)
    return request


def _fill_sampling(s: pb.Sampling, spec: SamplingSpec) -> None:
    s.temperature = spec.temperature
    s.top_p = spec.top_p
    s.top_k = spec.top_k
    s.min_p = spec.min_p
    if spec.seed is not None:
        s.seed = spec.seed
    if spec.logprobs is not None:
        s.logprobs = spec.logprobs


def sampled_tokens(reply: pb.GenerateResponse) -> StepAnswer:
    """The node's answer as plain data: its sampled tokens and prompt scores."""
    tokens = [
        SampledToken(t.seq_id, int(t.token_id), float(t.logprob) if t.HasField("logprob") else None,
                     tuple(zip(t.top_token_ids, t.top_logprobs)))
        for t in reply.tokens
    ]
    scores = {m.seq_id: _prompt_scores(m) for m in reply.prompt_logprobs}
    return StepAnswer(tokens, {seq_id: s for seq_id, s in scores.items() if s is not None})


def _prompt_scores(m: pb.PromptLogprobs) -> PromptScores | None:
    """None for a malformed answer (counts that do not line up): left out, the engine then
    fails the request that asked (`engine.prompt_scores`), never reads past the arrays."""
    n = len(m.logprobs)
    ids, lps = list(m.top_token_ids), list(m.top_logprobs)
    if len(m.ranks) != n or len(ids) != len(lps) or (len(ids) % n if n else len(ids)):
        return None
    k = len(ids) // n if n else 0
    top = tuple(tuple(zip(ids[i * k : (i + 1) * k], lps[i * k : (i + 1) * k])) for i in range(n))
    return PromptScores(tuple(m.logprobs), tuple(m.ranks), top)


def node_info(m: pb.GetNodeInfoResponse, address: str | None = None) -> NodeInfo:
    return NodeInfo(m.node_id, int(m.epoch), bool(m.registered), int(m.block_size), int(m.num_blocks), m.model,
                    int(m.vocab_size), int(m.max_model_len), tuple(m.eos_token_ids), address, m.device)


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

    def info(self, timeout_s: float | None = None) -> NodeInfo:
        """The node's model and pool (waits for the node to come up, `timeout_s` at most)."""
        try:
            m = self._stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=timeout_s or self.timeout_s,
                                       wait_for_ready=True, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise node_error(self.node_id, exc.code(), exc.details() or "") from exc
        return node_info(m, self.address)

    def generate(self, step: NodeStep) -> list[SampledToken]:
        try:
            reply = self._stub.Generate(generate_request(step), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise node_error(self.node_id, exc.code(), exc.details() or "") from exc
        return sampled_tokens(reply)

    def close(self) -> None:
        self._channel.close()


__all__ = ["CHANNEL_OPTIONS", "NodeExecutor", "RemoteNode", "generate_request", "node_error", "node_info",
           "sampled_tokens"]
