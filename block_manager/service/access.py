"""Who may call what on the block manager (the rule `pagedkv.guard.EdgeGuard` applies).

| method | principal |
|---|---|
| `BlockManagerAdmin/*` | `admin` (any name) |
| `BlockManager/RegisterNode`, `Heartbeat`, `GetTables` | `node:<id>` with `<id> == request.node_id` |
| `BlockManager/Step`, `SchedulerHeartbeat` | `scheduler`, or `scheduler:<id>` with `<id> == request.scheduler_id` |
| `BlockManager/Route` | `scheduler` / `scheduler:<id>` |
| `BlockManager/OpenSession` | `node`, `scheduler` or `admin` (a session id is a random secret) |
| `BlockManager/SubscribeKvEvents` | `subscriber` (any name) or `admin` (the CLI's `admin events`) |
| anything else of ours | nobody (a new RPC must be given its rule here) |

A node's credentials therefore cannot register, heartbeat or read tables as another node, a
scheduler's cannot register nodes or reach the admin plane, and only admin credentials reach
the admin plane. A request whose bytes do not parse carries no id to compare: it passes on the
role alone and the error mapping answers INVALID_ARGUMENT (nothing is applied).
"""

from __future__ import annotations

from typing import Any

from pagedkv.auth import Principal
from pagedkv.rpc import Undecodable

ADMIN_PREFIX = "/pagedkv.v1.BlockManagerAdmin/"
DATA_PREFIX = "/pagedkv.v1.BlockManager/"
NODE_METHODS = frozenset({"RegisterNode", "Heartbeat", "GetTables"})
SCHEDULER_METHODS = frozenset({"Step", "Route", "SchedulerHeartbeat"})
NAMED_SCHEDULER_METHODS = frozenset({"Step", "SchedulerHeartbeat"})   # checked against request.scheduler_id
SESSION_METHODS = frozenset({"OpenSession"})
SUBSCRIBER_METHODS = frozenset({"SubscribeKvEvents"})


def is_admin_method(method: str) -> bool:
    return method.startswith(ADMIN_PREFIX)


def authorize(method: str, principal: Principal, request: Any) -> str | None:
    """Why `principal` may not call `method` with `request`; None when it may."""
    if method.startswith(ADMIN_PREFIX):
        return None if principal.role == "admin" else f"{principal} may not use the admin plane"
    name = method.rsplit("/", 1)[-1]
    if not method.startswith(DATA_PREFIX):
        return f"{principal} may not call {method}"
    if name in SESSION_METHODS:
        if principal.role in ("node", "scheduler", "admin"):
            return None
        return f"{principal} may not open a client session"
    if name in SUBSCRIBER_METHODS:
        if principal.role in ("subscriber", "admin"):
            return None
        return f"{name} is for subscribers (and admins); {principal} is neither"
    if name in NODE_METHODS:
        if principal.role != "node":
            return f"{name} is for compute nodes; {principal} is not one"
        if isinstance(request, Undecodable) or request.node_id == principal.name:
            return None
        return f"{principal} may not act as node {request.node_id[:128]!r}"
    if name in SCHEDULER_METHODS:
        if principal.role != "scheduler":
            return f"{name} is for schedulers; {principal} is not one"
        if name in NAMED_SCHEDULER_METHODS and principal.name and not isinstance(request, Undecodable):
            if request.scheduler_id != principal.name:
                return f"{principal} may not act as scheduler {request.scheduler_id[:128]!r}"
        return None
    return f"{principal} may not call {name}"


__all__ = [
    "ADMIN_PREFIX", "DATA_PREFIX", "NAMED_SCHEDULER_METHODS", "NODE_METHODS", "SCHEDULER_METHODS",
    "SESSION_METHODS", "SUBSCRIBER_METHODS",
    "authorize",
    "is_admin_method",
]
