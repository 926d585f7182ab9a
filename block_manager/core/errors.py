"""Typed errors of the block manager core.

Every operation validates before it mutates, so whenever one of these is raised the
core's state is exactly what it was before the call. The service maps each class to one
gRPC status code (see docs/core_api.md); keeping the hierarchy small and flat makes that
mapping a lookup instead of string matching.
"""

from __future__ import annotations


class CoreError(Exception):
    """Base of every error the core raises on purpose."""


class OutOfBlocks(CoreError):
    """Not enough free or evictable blocks, or the watermark reserve would be touched."""


class InvalidRequest(CoreError):
    """Malformed input: empty tokens, negative counts, duplicate ids, bad geometry."""


class UnknownSequence(CoreError):
    """The sequence id is not present."""


class UnknownPool(CoreError):
    """The pool id is not present."""


class UnknownPlan(CoreError):
    """The defrag plan id is not present (never made, committed or aborted)."""


class SequenceExists(CoreError):
    """allocate/fork to a sequence id that is already present."""


class FailedPrecondition(CoreError):
    """The request is well formed but the current state forbids it."""


class PoolDraining(FailedPrecondition):
    """The pool is draining and admits no new sequences."""


class StaleEpoch(FailedPrecondition):
    """The caller's node epoch is older than the registered one."""


class NodeFenced(FailedPrecondition):
    """The node's lease expired; it is fenced off until it registers again."""


class DoubleFree(FailedPrecondition):
    """A sequence was freed twice (raised by layers that remember freed ids)."""


class PendingWrite(FailedPrecondition):
    """The request needs the content of a block whose writing Forward is not yet settled
    (e.g. a copy-on-write of a partial block filled in the current, unreported step)."""


class LateIdsPending(FailedPrecondition):
    """A sequence's last tokens still await their ids (late ids of an earlier append): it
    takes nothing else until the scheduler sends them."""


class PoolLeased(FailedPrecondition):
    """Another scheduler drives the pool and its lease has not lapsed."""


class StepsUnsettled(FailedPrecondition):
    """Too many closed steps of a pool await their Forward report, or a settle names a step
    that does not exist / was already settled."""


class VersionConflict(CoreError):
    """The caller's table version is newer than ours or otherwise inconsistent."""


def check_count(name: str, value: object, minimum: int) -> int:
    """`value` as a count of at least `minimum` (a plain int, bools refused), else InvalidRequest."""
    if type(value) is not int or value < minimum:
        raise InvalidRequest(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


__all__ = [
    "CoreError",
    "OutOfBlocks",
    "InvalidRequest",
    "UnknownSequence",
    "UnknownPool",
    "UnknownPlan",
    "SequenceExists",
    "FailedPrecondition",
    "PoolDraining",
    "StaleEpoch",
    "NodeFenced",
    "DoubleFree",
    "LateIdsPending",
    "PendingWrite",
    "PoolLeased",
    "StepsUnsettled",
    "VersionConflict",
]
