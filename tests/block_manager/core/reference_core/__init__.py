"""REFERENCE COPY (test-only) of the object-based block manager core as of bf0caa1, before
the array core (issue 20). The differential test runs it side by side with the new core;
bench/bench_core.py may import it too. Never imported by production code.

It keeps only what differs from the production core: the object-based tables, pool, appends,
steps, snapshot, fsck, defrag and types. What never changed is imported from production
(block_list, slots, hashing, errors: same code, so an oracle copy would test nothing), and
the node/lease registries, which the oracle's manager never used, are gone. defrag.py stays a
copy although it differs by one line: it drives the oracle's own pool, steps and sequence
objects (production's calls `seq.sync_last_block()`, which an object sequence lacks).

Block manager core: a pure, deterministic state machine over KV block pools.

No gRPC, no database, no clock, no randomness (see docs/core_api.md).
"""

from block_manager.core.errors import *  # noqa: F401,F403
from block_manager.core.errors import __all__ as _errors_all
from block_manager.core.hashing import hash_block, hash_prefix

from .manager import BlockManager
from .types import (
    AllocateResult,
    AppendFailure,
    AppendRequest,
    AppendResult,
    BlockId,
    CopyOp,
    DefragPlan,
    DefragPolicy,
    PlanId,
    PoolId,
    PoolMetrics,
    RouteEntry,
    SeqId,
    SequenceView,
    SettleResult,
    StepId,
    StepOutput,
    TableDelta,
)

__all__ = [
    *_errors_all,
    "AllocateResult", "AppendFailure", "AppendRequest", "AppendResult", "BlockId",
    "BlockManager", "CopyOp", "DefragPlan", "DefragPolicy", "PlanId", "PoolId",
    "PoolMetrics", "RouteEntry", "SeqId", "SequenceView", "SettleResult", "StepId", "StepOutput",
    "TableDelta", "hash_block", "hash_prefix",
]
