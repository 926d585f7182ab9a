"""Block manager core: a pure, deterministic state machine over KV block pools.

No gRPC, no database, no clock, no randomness (see docs/core_api.md).
"""

from block_manager.core.errors import *  # noqa: F401,F403
from block_manager.core.errors import __all__ as _errors_all
from block_manager.core.hashing import hash_block, hash_prefix
from block_manager.core.manager import BlockManager
from block_manager.core.types import (
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
