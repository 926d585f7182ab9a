"""The engine's side of a model node, as plain data: what one step asks of a node
(`NodeStep`), what the node answers (`SampledToken`s), what it serves (`NodeInfo`), and the
`NodeExecutor` protocol that carries them.

The scheduler speaks only these types and the typed node errors of `engine.errors`
(`NodeUnreachable`, `NodeMovedOn`, `NodeRefused`); the executors translate them to the node's
protocol: `engine.executor.RemoteNode` over gRPC, `engine.local_node.LocalNode` in process. So
neither grpc nor the node's protobuf reaches the scheduling code (tests/architecture checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from block_manager.client import PoolStepInfo


@dataclass(slots=True, frozen=True)
class SamplingSpec:
    temperature: float
    top_p: float
    top_k: int                   # 0: off
    min_p: float
    seed: int | None
    logprobs: int | None         # None: none; 0: the sampled token's; k: also the top k


@dataclass(slots=True, frozen=True)
class PromptLogprobsSpec:
    """Score prompt tokens from this step's rows: new token i predicts `target_token_ids[i]`
    (the prompt token after it), for the first `len(target_token_ids)` new tokens; also the
    `num_top` most likely tokens of each of those rows."""

    num_top: int
    target_token_ids: tuple[int, ...]


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step: its new token ids, at positions
    `context_len - len(token_ids) … context_len - 1`; it samples when `sampling` is set, and
    scores prompt tokens when `prompt_logprobs` is set."""

    seq_id: str
    token_ids: list[int]
    context_len: int
    num_output_tokens: int       # the index of the token to sample (seeded draws)
    sampling: SamplingSpec | None = None
    prompt_logprobs: PromptLogprobsSpec | None = None


@dataclass(slots=True)
class NodeStep:
    """One Generate: the block manager's step for the node's pool (copy ops and table deltas
    to apply first), then the sequences to compute. `request_id` makes a retry idempotent."""

    request_id: str
    pool_steps: list[PoolStepInfo] = field(default_factory=list)
    sequences: list[SeqStep] = field(default_factory=list)
    profile: bool = False        # ask the node for its phase timings (device syncs on a GPU)


@dataclass(slots=True, frozen=True)
class SampledToken:
    seq_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first


@dataclass(slots=True, frozen=True)
class PromptScores:
    """A node's answer to a `PromptLogprobsSpec`, one entry per target, in order: the target's
    raw log-probability, its rank in the vocabulary (1: the most likely) and the top tokens
    (token id, logprob), most likely first."""

    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


class StepAnswer(list[SampledToken]):
    """What a node answers for one step: the sampled tokens (one per sequence that samples, in
    step order: the list itself, which is all a step without prompt scoring needs) and, by
    sequence id, the `PromptScores` of the sequences whose `SeqStep` asked for them."""

    def __init__(self, tokens: list[SampledToken] | None = None,
                 prompt_logprobs: dict[str, PromptScores] | None = None) -> None:
        super().__init__(tokens or ())
        self.prompt_logprobs: dict[str, PromptScores] = prompt_logprobs or {}


@dataclass(slots=True, frozen=True)
class NodeInfo:
    node_id: str
    epoch: int
    registered: bool
    block_size: int
    num_blocks: int
    model: str                   # "" : attention only (no model)
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    address: str | None = None   # None: the node runs in this process
    device: str = ""             # "cpu", "cuda:0", ... ("": not reported)


class NodeExecutor(Protocol):
    """A model node as the engine drives it. `generate` answers one token per sequence that
    samples, in step order, or raises `NodeUnreachable` / `NodeMovedOn` / `NodeRefused`."""

    node_id: str

    def info(self, timeout_s: float | None = None) -> NodeInfo: ...

    def generate(self, step: NodeStep) -> list[SampledToken]: ...

    def close(self) -> None: ...


__all__ = ["NodeExecutor", "NodeInfo", "NodeStep", "PromptLogprobsSpec", "PromptScores", "SampledToken",
           "SamplingSpec", "SeqStep", "StepAnswer"]
