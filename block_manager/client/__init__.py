"""Client library of the block manager service: sync and asyncio data-plane clients, the
scheduler-step helper (one `Step` RPC per scheduler step, none for in-block decode), an
admin-plane client and typed errors. See `step.py` for the step contract and the deferred
in-block append protocol."""

from block_manager.client.admin import AdminClient
from block_manager.client.async_client import AsyncBlockManagerClient, AsyncStep
from block_manager.client.errors import (
    AbortedError,
    AlreadyExistsError,
    BlockManagerError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfBlocksError,
    PendingWriteError,
    PermissionDeniedError,
    PoolDrainingError,
    PoolGoneError,
    StepStateError,
    UnauthenticatedError,
    UnavailableError,
)
from block_manager.client.retry import NO_RETRY, ClientStats, RetryPolicy, new_request_id
from block_manager.client.step import SequenceTracker, StepResult
from block_manager.client.sync_client import BlockManagerClient, SyncStep
from block_manager.client.types import (
    Admission,
    FleetAssignment,
    HeartbeatResult,
    ItemFailure,
    NodeRegistration,
    OwnedPool,
    PoolRoute,
    PoolStepInfo,
    SchedulerStatus,
    SeqSlots,
    StepSettled,
    TablesUpdate,
)

__all__ = [
    "AbortedError",
    "Admission",
    "AdminClient",
    "AlreadyExistsError",
    "AsyncBlockManagerClient",
    "AsyncStep",
    "BlockManagerClient",
    "BlockManagerError",
    "ClientStats",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FleetAssignment",
    "HeartbeatResult",
    "InternalError",
    "InvalidArgumentError",
    "ItemFailure",
    "NO_RETRY",
    "NodeRegistration",
    "NotFoundError",
    "OutOfBlocksError",
    "OwnedPool",
    "PendingWriteError",
    "PermissionDeniedError",
    "PoolDrainingError",
    "PoolGoneError",
    "PoolRoute",
    "PoolStepInfo",
    "RetryPolicy",
    "SchedulerStatus",
    "SeqSlots",
    "SequenceTracker",
    "StepResult",
    "StepSettled",
    "StepStateError",
    "SyncStep",
    "TablesUpdate",
    "UnauthenticatedError",
    "UnavailableError",
    "CancelledError",
    "new_request_id",
]
