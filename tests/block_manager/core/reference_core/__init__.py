"""REFERENCE COPY (test-only) of the object-based block manager core as of bf0caa1, before
the array core (issue 20). The differential test runs it side by side with the new core;
bench/bench_core.py may import it too. Never imported by production code.

Block manager core: a pure, deterministic state machine over KV block pools.

No gRPC, no database, no clock, no randomness (see docs/core_api.md).
"""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .hashing import hash_block, hash_prefix
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
