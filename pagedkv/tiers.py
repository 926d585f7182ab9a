"""The kinds of a tier move, as `PoolStep.tier_kind` numbers them (proto/pagedkv/v1/common.proto).

The block manager decides the moves, the compute node runs them and the engine counts them; all
three read the same numbers off the wire. `TierKind` is an `IntEnum` so those numbers stay
exactly what the protobuf column and the journal hold (a member *is* its number), while the
code names the move instead of comparing against a bare 1..6.
"""

from __future__ import annotations

from enum import IntEnum


class TierKind(IntEnum):
    """One tier move: which tier a block leaves and which it lands in."""

    SWAP_OUT = 1       # device -> host: a preempted sequence's blocks
    SWAP_IN = 2        # host -> device: a swapped-out sequence resumes
    OFFLOAD = 3        # device -> host: a cached prefix block kept past its eviction
    ONBOARD = 4        # host -> device: a cached prefix block reused from the host tier
    DISK_OFFLOAD = 5   # host -> disk: its identity rides in `PoolStep.disk_blocks`
    DISK_ONBOARD = 6   # disk -> host

    @property
    def to_host(self) -> bool:
        """Device -> host (the node copies out of its pool)."""
        return self in (TierKind.SWAP_OUT, TierKind.OFFLOAD)

    @property
    def to_device(self) -> bool:
        """Host -> device (the node copies into its pool)."""
        return self in (TierKind.SWAP_IN, TierKind.ONBOARD)

    @property
    def is_disk(self) -> bool:
        """Between the host tier and the disk tier."""
        return self in (TierKind.DISK_OFFLOAD, TierKind.DISK_ONBOARD)

    @classmethod
    def of(cls, name: str) -> TierKind:
        """The kind the core names `name` (`"swap_out"`, ..., `"disk_onboard"`)."""
        return cls[name.upper()]


__all__ = ["TierKind"]
