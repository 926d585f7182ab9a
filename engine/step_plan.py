"""The values one engine step passes between its parts, and what the engine knows of its nodes.

`Scheduler.plan` fills a `StepPlan` (and the block-manager Step beside it); `Scheduler.apply`
turns the Step's answer into `Work` per node; `NodePipeline` turns that work into an
`InFlight` step of `NodeJob`s (one Generate per node). `NodeView` is the one place the engine's
knowledge of its nodes lives (their geometry, the last free counts, which are out of placement),
handed to each part that reads it. Data only: no part of the step is decided here.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from block_manager.client import PoolStepInfo
from engine.errors import NodeError
from engine.node_api import NodeExecutor, NodeStep, PromptLogprobsSpec, SampledToken, SeqStep
from engine.sequence import SeqStatus, Sequence

PLACEHOLDER = -1             # the id of a speculative token until its step's answer arrives


@dataclass(slots=True)
class Work:
    """One sequence's share of a node's Generate in one step."""

    seq: Sequence
    seq_id: str                  # the admission that computes it (a token is accepted only for it)
    token_ids: list[int]
    context_len: int
    sample: bool
    speculative: bool = False    # its one token is the one the step in flight samples
    dropped: bool = False        # speculative, and its sequence did not go on as speculated
    scoring: PromptLogprobsSpec | None = None   # the prompt tokens its node scores (engine.prompt_scores)

    @property
    def live(self) -> bool:
        """Whether its sequence still runs as the admission that planned it."""
        return not self.dropped and self.seq.status is SeqStatus.RUNNING and self.seq.seq_id == self.seq_id


@dataclass(slots=True)
class StepPlan:
    """What one Step asks for: swap-outs and swap-ins, appends (as the work they become), forks
    with their children's new ids, admissions with their new ids."""

    swapping_out: list[Sequence] = field(default_factory=list)
    swapping_in: list[Sequence] = field(default_factory=list)
    appends: list[Work] = field(default_factory=list)
    children_of: dict[Sequence, list[tuple[Sequence, str]]] = field(default_factory=dict)
    admitted: list[tuple[Sequence, str]] = field(default_factory=list)


@dataclass(slots=True)
class NodeJob:
    node_id: str
    info: PoolStepInfo | None        # the block manager's step for the node's pool (reported after)
    items: list[Work]
    step: NodeStep
    answer: list[SampledToken] | NodeError | None = None

    @property
    def tokens(self) -> list[SampledToken] | None:
        """The node's sampled tokens; None while unanswered or when it failed."""
        return self.answer if isinstance(self.answer, list) else None


@dataclass(slots=True)
class InFlight:
    """A launched step: its Generates, and each sequence's work in it."""

    jobs: list[NodeJob]
    by_seq: dict[Sequence, Work] = field(default_factory=dict)
    speculative: list[tuple[Work, SeqStep]] = field(default_factory=list)
    futures: list[Future[list[SampledToken] | NodeError]] = field(default_factory=list)   # while launched
    started_s: float = 0.0


@dataclass(slots=True)
class NodeView:
    """What the engine knows of its nodes, shared (one object) by the engine, the scheduler, the
    swap policy and the pipeline. Written by the engine (discovery, the Step answers, health)
    between steps; read by the others."""

    nodes: dict[str, NodeExecutor]                       # by pool id
    pool_blocks: dict[str, tuple[int, int]]              # pool -> (num_blocks, block_size)
    max_model_len: int
    pool_free: dict[str, tuple[int, int]] = field(default_factory=dict)   # pool -> (free, usable), last Step
    host_pools: set[str] = field(default_factory=set)    # pools with a host tier (their answers say so)
    down: frozenset[str] = frozenset()                   # out of placement, read once per step
    releasing: frozenset[str] = frozenset()              # fleet: handed over soon, no admissions (engine.fleet_pools)

    def block_size(self, node_id: str) -> int:
        return self.pool_blocks.get(node_id, (0, 1))[1]


__all__ = ["PLACEHOLDER", "InFlight", "NodeJob", "NodeView", "StepPlan", "Work"]
