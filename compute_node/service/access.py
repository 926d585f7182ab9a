"""Who may call what on a compute node (the rule `pagedkv.guard.EdgeGuard` applies).

| method | principal |
|---|---|
| `ComputeNode/Forward` | `scheduler` / `scheduler:<id>`: a Forward writes into the node's KV memory |
| `ComputeNode/Generate` | `scheduler` / `scheduler:<id>`: the model-level step writes KV memory too |
| `ComputeNode/GetNodeInfo` | `scheduler`, `admin` |
| `ComputeNode/FetchBlocks` | `node:<id>`: a node pulling prefix blocks granted to it (`<id>` = the grant's) |
| anything else of ours | nobody (a new RPC must be given its rule here) |

Nodes call each other only to pull granted prefix blocks (docs/prefix_fetch.md), and the block
manager never calls a node: a `node:*` principal (another node's certificate from the same CA)
is refused everything else.
"""

from __future__ import annotations

from typing import Any

from pagedkv.auth import Principal

PREFIX = "/pagedkv.v1.ComputeNode/"
_ALLOWED = {
    "Forward": frozenset({"scheduler"}),
    "Generate": frozenset({"scheduler"}),
    "GetNodeInfo": frozenset({"scheduler", "admin"}),
    "FetchBlocks": frozenset({"node"}),
}


def authorize(method: str, principal: Principal, request: Any) -> str | None:
    """Why `principal` may not call `method`; None when it may."""
    roles = _ALLOWED.get(method.rsplit("/", 1)[-1]) if method.startswith(PREFIX) else None
    if roles is None:
        return f"{principal} may not call {method}"
    if principal.role not in roles:
        return f"{method.rsplit('/', 1)[-1]} is for {' and '.join(sorted(roles))} principals; {principal} is not one"
    return None


__all__ = ["PREFIX", "authorize"]
